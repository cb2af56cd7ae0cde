"""Generation for transformers causal LMs, split by TP and PP (how: ``decoder_split``).

Each rank runs its stage's part of the model's own backbone forward. The last stage's TP ranks turn the
last hidden state into logits as the model's forward does (vocabulary blocks gathered, then its logit
scaling or soft-capping), pick the next tokens and broadcast them to every rank, which keeps all ranks
in lock step and lets them stop together.
"""
from __future__ import annotations

import inspect
import time
from typing import Any, Dict, Optional

import torch

from ..comm import p2p
from .decode_compile import DecodeCompiler
from .base import BatchingDefaults, GenerativeRunner, ParkResult, StageContext, StepResult
from .families import decoder_family
from .row_split import gather_vocab


def causal_lm_family(module) -> Optional[str]:
    """The family name (``families``: 'opt', 'llama', or the model type of a decoder split by its
    transformers plans) of the causal LMs this runner can shard, else None."""
    fam = decoder_family(module)
    return fam.name if fam is not None else None


def has_sliding_window(config) -> bool:
    """Whether some attention layer of this config sees only a window of the latest keys."""
    types = getattr(config, "layer_types", None)
    if types:
        return "sliding_attention" in types
    return getattr(config, "sliding_window", None) is not None and getattr(config, "use_sliding_window", True)


def finish_logits(logits: torch.Tensor, config) -> torch.Tensor:
    """What the model's own forward does to the LM head's output: Granite divides by ``logits_scaling``,
    Cohere multiplies by ``logit_scale``, Gemma soft-caps with ``final_logit_softcapping``."""
    scaling = getattr(config, "logits_scaling", None)
    if scaling not in (None, 1, 1.0):
        logits = logits / scaling
    scale = getattr(config, "logit_scale", None)
    if scale not in (None, 1, 1.0):
        logits = logits * scale
    cap = getattr(config, "final_logit_softcapping", None)
    if cap:
        logits = torch.tanh(logits / cap) * cap
    return logits


def _eos_ids(eos, device) -> Optional[torch.Tensor]:
    """EOS as a tensor of ids: configs give one id, a list of them (Llama 3), or none."""
    if eos is None:
        return None
    ids = [eos] if isinstance(eos, int) else list(eos)
    return torch.tensor(ids, dtype=torch.int64, device=device) if ids else None


def _running_batch(config, ctx: StageContext, module, layers: int):
    """The model's running sequences: in a paged KV pool (first blocks: ``kv_reserve`` of this stage's weight
    bytes) read through the backend ``attention`` chooses and installs, or in a left-padded DynamicCache."""
    if ctx.kv_cache == "paged":
        from . import attention
        from .kv_pool import initial_blocks
        from .paged_running import PagedBatch
        weights = sum(p.numel() * p.element_size() for p in module.parameters())
        batch = PagedBatch(config, ctx.kv_block_size, initial_blocks(config, ctx.tp, layers, ctx.kv_block_size,
                                                                     ctx.kv_reserve * weights), ctx.prefix_cache)
        batch.cache.backend = attention.choose(ctx.attention_backend, config, ctx.device, ctx.cpu_attention)
        attention.install(module, batch.cache.backend)
        return batch
    from .running import RunningBatch
    return RunningBatch()


class CausalLMRunner(GenerativeRunner):
    def __init__(self, model, model_config, ctx: StageContext):
        from .decoder_split import cut_decoder
        self.ctx = ctx
        family = decoder_family(model)
        self.family, self.family_entry = family.name, family
        self.config = model.config
        cut = cut_decoder(model, family, ctx)
        base = self.base = cut.base
        self.layer_ids = cut.layer_ids
        """The model-wide index of each of this stage's layers (what checkpoints and adapters name)."""
        self.lm_head, self.vocab_parallel, self.vocab = cut.lm_head, cut.vocab_parallel, cut.vocab
        self.model = model
        self.module = model
        self.segments = [m for m in (cut.embedding,) if m is not None] + list(cut.layers) + \
            [m for m in (cut.lm_head,) if m is not None]
        self.sliding = has_sliding_window(self.config)
        """Prompts joining running sequences get a forward of their own: one shared forward would leave
        masked columns inside a running row's recent keys, which a sliding window counts."""
        params = inspect.signature(base.forward).parameters
        self._cache_kw = "cache" if "cache" in params else "past_key_values"
        self.running = _running_batch(self.config, ctx, model, len(self.layer_ids))
        """The model's sequences between steps (token-level generation)."""
        self.lora = None
        """``lora.slots.LoraSlots`` once an adapter was added: applies each row's adapter in a step."""
        paged = getattr(self.running, "paged", False)
        self.decode = DecodeCompiler(base, ctx.compile_decode, ctx.device, graphs=paged,
                                     eager_first=ctx.pack_linears and ctx.device.type == "cpu")
        """The backbone, compiled for decode steps without adapters (``decode_compile``); CUDA graphs for the
        paged pool, whose decode gathers then come in few widths."""
        if paged and self.decode.enabled and self.decode.device_type == "cuda":
            self.running.cache.pow2_width = True

    def _dtype(self) -> torch.dtype:
        p = next(iter(self.module.parameters()), None)
        return p.dtype if p is not None and p.is_floating_point() else torch.float32

    def batching_defaults(self) -> BatchingDefaults:
        """What a batch manager needs to know about this model's token ids."""
        return BatchingDefaults.from_config(self.config, getattr(self.model, "generation_config", None))

    # ---- one forward of this stage ------------------------------------------
    def _stage_forward(self, x, attention_mask, position_ids, cache, score=None):
        """This stage's forward; on the last stage the logits of each row's last position. ``score``
        (last stage): ``{row: n}`` for the rows whose prompt (their last ``n`` positions) is scored too,
        filled in place with the logits of positions ``-n .. -2`` ([n - 1, V], each predicting the next)."""
        kwargs = {"attention_mask": attention_mask, self._cache_kw: cache, "use_cache": True}
        kwargs.update(getattr(cache, "forward_kwargs", dict)())  # the paged attention backend's step metadata
        if position_ids is not None:
            kwargs["position_ids"] = position_ids
        if self.ctx.is_first:
            kwargs["input_ids"] = x
        else:
            kwargs["inputs_embeds"] = x
        decode = x.shape[1] == 1 and (self.lora is None or not self.lora.applying)
        hidden = self.decode(decode, **kwargs).last_hidden_state
        if not self.ctx.is_last:
            return hidden
        last = getattr(cache, "last_index", None)  # paged: one ragged row, each sequence's last token
        for row, n in sorted((score or {}).items()):
            if n > 1:
                end = int(last[row]) if last is not None else None
                score[row] = self._logits(hidden[0, end - n + 1:end] if end is not None else hidden[row, -n:-1, :])
        return self._logits(hidden[0, last] if last is not None else hidden[:, -1, :])

    def _logits(self, hidden: torch.Tensor) -> torch.Tensor:
        """The model's final logits [N, V] of hidden states [N, H] (every TP rank of the last stage)."""
        logits = self.lm_head(hidden)
        if self.vocab_parallel:
            logits = gather_vocab(logits, self.vocab, self.ctx.tp, self.ctx.groups.tp_group)
        return finish_logits(logits.float(), self.config)

    def _positions(self, attention_mask: torch.Tensor, new: int, cache=None) -> Optional[torch.Tensor]:
        if getattr(cache, "position_ids", None) is not None:  # paged: the step's positions, from the pool
            return cache.position_ids
        if self.family == "opt":
            return None  # OPT derives positions from the attention mask itself
        pos = attention_mask.long().cumsum(-1) - 1
        pos = pos.masked_fill(attention_mask == 0, 1)
        return pos[:, -new:]

    @staticmethod
    def _pick(logits: torch.Tensor, batch: Dict[str, Any], gen: Optional[torch.Generator]) -> torch.Tensor:
        """The next token of every row: a request-level batch shares its sampling parameters (the batch
        manager groups requests by them) and one generator, seeded with the batch's seed."""
        from .sampling import sample_rows
        return sample_rows(logits, batch.get("temperature"), batch.get("top_k"), batch.get("top_p"), gen)

    def run(self, batch: Dict[str, Any], weights_ready) -> Optional[torch.Tensor]:
        """Request-level generation: the whole decode loop of one batch inside one command.

        Serves ``RunBatch``, which the master sends for a causal LM only when it does not generate
        token by token: ``EngineConfig.step_mode=False``, ``paper_mode`` (the paper's unit of work), or
        a batch manager other than ``CausalLMBatchManager``. The batch is what its batch manager built
        (``input_ids``, ``attention_mask``, ``max_new_tokens``, eos/pad ids and one set of sampling
        parameters for all rows); it runs until every row has hit an EOS or ``max_new_tokens``, and the
        output rank returns the new tokens [B, n] (rows that ended early are padded). Nothing stays on
        the device afterwards: no KV cache outlives the command, so nothing is parked or dropped.
        """
        from transformers import DynamicCache
        ctx, g, dev = self.ctx, self.ctx.groups, self.ctx.device
        ids = batch["input_ids"].to(dev)
        mask = batch["attention_mask"].to(dev)
        bsz = ids.shape[0]
        max_new = int(batch["max_new_tokens"])
        eos = _eos_ids(batch.get("eos_token_id"), dev)
        pad = batch.get("pad_token_id", 0) or 0
        gen = None
        cache = DynamicCache()
        finished = torch.zeros(bsz, dtype=torch.bool, device=dev)
        out = []
        cur = ids
        for _ in range(max_new):
            ok, err = True, None
            tokens = torch.empty(bsz, dtype=torch.int64, device=dev)
            try:
                x = cur if ctx.is_first else p2p.recv_tensor(g.prev_rank(), g.data, dev)
                if not out:
                    weights_ready()
                    if ctx.is_output_rank and batch.get("temperature"):  # inside: a bad seed fails every rank
                        gen = torch.Generator(device=dev).manual_seed(int(batch.get("seed", 0)))
                y = self._stage_forward(x, mask, self._positions(mask, cur.shape[1]), cache)
                if not ctx.is_last:
                    p2p.send_tensor(y, g.next_rank(), g.data, dev)
                elif ctx.is_output_rank:
                    tokens.copy_(self._pick(y, batch, gen))
            except Exception as exc:  # noqa: BLE001 - every rank must leave this step together
                ok, err = False, exc
                if not ctx.is_last:
                    p2p.send_tensor(None, g.next_rank(), g.data, dev)
            if not p2p.broadcast_with_status(tokens, ok or not ctx.is_output_rank,
                                            g.layout.output_rank, g.data):
                raise err if err is not None else p2p.UpstreamFailed("the last pipeline stage failed")
            if err is not None:
                raise err
            if eos is not None:
                tokens = torch.where(finished, torch.full_like(tokens, pad), tokens)
                finished |= torch.isin(tokens, eos)
            out.append(tokens)
            cur = tokens[:, None]
            mask = torch.cat([mask, mask.new_ones(bsz, 1)], dim=1)
            if eos is not None and bool(finished.all()):
                break
        if not ctx.is_output_rank:
            return None
        return torch.stack(out, dim=1).cpu() if out else torch.empty(bsz, 0, dtype=torch.int64)

    # ---- token-level generation ---------------------------------------------
    def kv_bytes(self) -> int:
        """KV caches on the device (not those parked in host memory)."""
        return 0 if self.running.parked else self.running.kv_bytes()

    def host_kv_bytes(self) -> int:
        return self.running.kv_bytes() if self.running.parked else 0

    def release_resident(self) -> int:
        """Also lets the compiled decode step go where it holds device memory (``DecodeCompiler.offload``)."""
        self.decode.offload()
        return super().release_resident()

    def park_running(self, recompute) -> ParkResult:
        """The model leaves the device: drop the sequences to be recomputed (their sampling generators'
        states go back to the master) and park the others' KV caches in host memory."""
        t0 = time.perf_counter()
        states = self.running.generator_states(recompute) if self.ctx.is_output_rank else {}
        self.running.drop(recompute)
        nbytes = self.running.park()
        return ParkResult(kv_parked_bytes=nbytes, kv_park_s=time.perf_counter() - t0, gen_states=states)

    def drop_sequences(self, sids) -> None:
        self.running.drop(sids)

    def drop_all(self) -> None:
        """Also drops the compiled decode step (the model is removed)."""
        self.running.clear()
        self.decode.release()

    def forget_prefixes(self) -> None:
        """An adapter left: the paged pool's cached prompt blocks are not reused (``PagedBatch``)."""
        self.running.forget_prefixes()

    def _chain(self, x, mask, new: int, cache, failed: bool, score=None):
        """One forward through the pipeline: receive, run this stage, pass on.

        Every stage makes the same transfers whether or not it failed (a failed
        stage still consumes what its upstream sends and sends a failure marker
        down), so the point-to-point pairs stay in step for the next forward.
        Returns (logits on the last stage or None, failed, error).
        """
        ctx, g, dev = self.ctx, self.ctx.groups, self.ctx.device
        err = None
        y = None
        try:
            if not ctx.is_first:
                x = p2p.recv_tensor(g.prev_rank(), g.data, dev)
            if failed:
                raise p2p.UpstreamFailed("an earlier forward of this step failed")
            y = self._stage_forward(x, mask, self._positions(mask, new, cache), cache, score)
        except Exception as exc:  # noqa: BLE001 - passed downstream, agreed on by the token broadcast
            err, failed, y = exc, True, None
        if not ctx.is_last:
            p2p.send_tensor(None if failed else y, g.next_rank(), g.data, dev)
            y = None
        return y, failed, err

    def _forward_with_adapters(self, rows, ids, mask, new: int, cache, failed: bool, score=None):
        """``_chain`` with row ``i`` on adapter ``rows[i]`` (where any row has one); a failure to bring an
        adapter in fails this forward on this rank, which still makes its transfers."""
        lora, err = (self.lora if any(r is not None for r in rows) else None), None
        try:
            if lora is not None and not failed:
                lora.activate(rows)
        except Exception as exc:  # noqa: BLE001
            failed, err = True, exc
        try:
            y, failed, e = self._chain(ids, mask, new, cache, failed, score)
        finally:
            if lora is not None:
                lora.deactivate()
        return y, failed, err or e

    def step(self, cmd, weights_ready) -> StepResult:
        """Drop, prefill the admitted sequences, decode the running ones: one token each.

        Every rank runs this with the same command and ends in the same state: the output rank's
        status, tokens and which sequences they end travel in one broadcast, and on failure every rank
        drops the model's whole running batch. Admitted sequences with the same prompt and adapter
        share one prefill row, copied into each of them after the forward.
        """
        from .running import RunningBatch
        from .sampling import SeqSampler, pick, prompt_logprobs, scored_logits, seq_generator
        ctx, g, dev = self.ctx, self.ctx.groups, self.ctx.device
        rb: RunningBatch = self.running
        rb.drop(cmd.drop)
        t_restore = time.perf_counter()
        restored = rb.unpark(dev)
        t_restore = time.perf_counter() - t_restore
        n_run, admit = len(rb), list(cmd.admit)
        paged = getattr(rb, "paged", False)  # one ragged row: no padding, so never a forward apart
        if paged:  # uniq: a spec per prefill row (a chunk, or a whole prompt); admit: those complete now
            uniq, chunk_ends, admit, share = rb.pieces(admit, cmd.fill)
        else:
            firsts, share = rb.shared_prefill(admit)
            uniq = [admit[i] for i in firsts]
        prompts = [list(a.prompt) for a in uniq]
        if not n_run and not uniq:  # only drops (every rank knows): nothing to run or to agree on
            return StepResult(kv_restored_bytes=restored, kv_restore_s=t_restore)
        scored = {share[i] for i, a in enumerate(admit) if a.prompt_logprobs is not None and not a.generated}
        score = {j: len(uniq[j].prompt) for j in sorted(scored)}
        picked = torch.empty(2, n_run + len(admit), dtype=torch.int64, device=dev)  # tokens, ends
        failed, err = False, None
        rows = [rb.specs[s].adapter for s in rb.sids] + [a.adapter for a in uniq]
        try:
            weights_ready()
        except Exception as exc:  # noqa: BLE001
            failed, err = True, exc
        pad = int(self.batching_defaults().pad_token_id)
        apart = bool((cmd.prefill_apart or self.sliding) and n_run and admit and not paged)
        if paged:
            ids, mask, width = rb.step_inputs(prompts, [a.sid for a in uniq], dev, self._dtype(),
                                              [rb.cache_seed(a) for a in uniq], chunk_ends)
            if not width:  # only chunks the prefix cache held (the same on every rank): nothing to run
                if failed:
                    rb.clear()
                    raise err
                return StepResult(kv_restored_bytes=restored, kv_restore_s=t_restore)
            score = {n_run + j: n for j, n in score.items()}
            forwards = [(rb.token_rows(rows), ids, mask, width, rb.cache, score)]
        elif apart:  # (adapters of the rows, input ids, mask, new columns, cache, scored rows) of each forward
            ids, mask = rb.decode_inputs()
            new_ids, new_mask, width, new_cache = rb.prefill_inputs(prompts, pad, dev)
            forwards = [(rows[:n_run], ids, mask, 1, rb.cache, None),
                        (rows[n_run:], new_ids, new_mask, width, new_cache, score)]
        else:
            ids, mask, width = rb.step_inputs(prompts, pad, dev)
            score = {n_run + j: n for j, n in score.items()}
            forwards = [(rows, ids, mask, width, rb.cache, score)]
        logits = []
        for f_rows, f_ids, f_mask, f_new, f_cache, f_score in forwards:
            y, failed, e = self._forward_with_adapters(f_rows, f_ids, f_mask, f_new, f_cache, failed, f_score)
            err = err or e
            logits.append(y)
        y = None if failed or logits[-1] is None else torch.cat(logits)
        index = list(range(n_run)) + [n_run + r for r in share]  # every row's logits and KV row
        generators, samplers, lps, plps, host = {}, {}, (), {}, None
        if ctx.is_output_rank and not failed:
            try:  # on the device: only the picked ids and asked-for logprobs come to the host (``sampling``)
                if index != list(range(len(y))):  # an empty index too (a step of chunks only)
                    y = y.index_select(0, torch.tensor(index, dtype=torch.long, device=y.device))
                generators = {a.sid: seq_generator(a, y.device) for a in admit}
                gens = {**rb.generators, **generators}
                samplers = {a.sid: SeqSampler(a, gens.get(a.sid)) for a in admit}
                specs = [rb.specs[s] for s in rb.sids] + admit
                got = pick(y, specs, {**rb.samplers, **samplers}, gens)
                lps, host = got.logprobs, [got.ids, [int(e) for e in got.ends]]
                picked[0].copy_(got.tokens)
                picked[1].copy_(torch.tensor(host[1], dtype=torch.int64))
                offset = 0 if apart else n_run
                plps = {a.sid: prompt_logprobs(scored_logits(score.get(offset + share[i]), y.shape[-1], y.device),
                                               a.prompt, a.prompt_logprobs)
                        for i, a in enumerate(admit) if share[i] in scored and a.prompt_logprobs is not None}
            except Exception as exc:  # noqa: BLE001
                failed, err = True, exc
        if not p2p.broadcast_with_status(picked, not (failed and ctx.is_output_rank),
                                        g.layout.output_rank, g.data) or failed:
            rb.clear()
            raise err if err is not None else p2p.UpstreamFailed("the last pipeline stage failed")
        if not paged and len(uniq) < len(admit):
            if apart:
                new_mask = rb.copy_rows(new_cache, new_mask, share)
            else:
                mask = rb.copy_rows(rb.cache, mask, index)
        if apart:
            mask = rb.merge_prefilled(mask, new_mask, new_cache)
        tokens = picked[0].clone()
        rb.joined(admit, generators, mask, tokens, samplers)
        toks, ends = host if host is not None else picked.tolist()  # the output rank has them already
        sids = list(rb.sids)
        ended = rb.ended([bool(e) for e in ends])
        rb.drop(ended)
        return StepResult(sids=tuple(sids), tokens=tuple(toks), ended=tuple(ended), running=len(rb),
                          kv_restored_bytes=restored, kv_restore_s=t_restore, logprobs=lps, prompt_logprobs=plps,
                          prefill_tokens=rb.prefilled if paged else sum(len(p) for p in prompts))
