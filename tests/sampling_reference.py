"""The sampling controls' documented semantics, written out a second time over the unsharded transformers
model: one full forward per step (no cache), the controls applied to that step's last logits in the
documented order (logit_bias, min_tokens, repetition, frequency/presence, then temperature, min_p, top_k,
top_p), greedy or drawn with the sequence's own seeded generator as the engine draws."""
import torch


def controlled(raw, prompt, gen, stops, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
               logit_bias=None, min_tokens=0):
    """A row of raw logits with the controls applied, one token at a time in Python (a new tensor)."""
    x = raw.clone()
    for t, b in (logit_bias or {}).items():
        x[int(t)] += b
    if len(gen) < min_tokens:
        for t in stops:
            x[t] = float("-inf")
    if repetition_penalty != 1.0:
        for t in set(prompt) | set(gen):
            x[t] = x[t] / repetition_penalty if x[t] > 0 else x[t] * repetition_penalty
    for t in set(gen):
        x[t] -= frequency_penalty * gen.count(t) + presence_penalty
    return x


def drawn(x, g, temperature=0.0, top_k=0, top_p=1.0, min_p=0.0):
    """The token of a controlled row: its argmax, or one ``multinomial`` draw of generator ``g`` from the
    row divided by ``temperature`` and cut by min_p, top_k and top_p."""
    if not temperature or top_k == 1:
        return int(x.argmax())
    x = x / temperature
    if min_p:
        p = x.softmax(-1)
        x[p < min_p * p.max()] = float("-inf")
    if top_k:
        x[x < torch.topk(x, top_k).values[-1]] = float("-inf")
    if top_p < 1.0:
        s, idx = torch.sort(x, descending=True)
        p = s.softmax(-1)
        s[p.cumsum(-1) - p > top_p] = float("-inf")
        x = torch.full_like(x, float("-inf")).scatter(-1, idx, s)
    return int(torch.multinomial(x.softmax(-1)[None], 1, generator=g)[0, 0])


def reference(model, prompt, max_tokens, eos=(2,), temperature=0.0, top_k=0, top_p=1.0, seed=0,
              presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0, logit_bias=None, min_p=0.0,
              min_tokens=0, ignore_eos=False, stop_token_ids=(), logprobs=None):
    """``(tokens, [(logprob, top)...])`` of one request."""
    gen, lps = [], []
    stops = set(stop_token_ids) | (set() if ignore_eos else set(eos))
    g = torch.Generator().manual_seed(seed) if temperature and top_k != 1 else None
    with torch.no_grad():
        for _ in range(max_tokens):
            raw = model(torch.tensor([list(prompt) + gen])).logits[0, -1].float()
            x = controlled(raw, prompt, gen, stops, presence_penalty, frequency_penalty, repetition_penalty,
                           logit_bias, min_tokens)
            tok = drawn(x, g, temperature, top_k, top_p, min_p)
            lp = torch.log_softmax(raw, -1)
            k = logprobs or 0
            vals, ids = torch.topk(lp, k) if k else (torch.empty(0), torch.empty(0, dtype=torch.long))
            lps.append((float(lp[tok]), list(zip(ids.tolist(), vals.tolist()))))
            gen.append(tok)
            if tok in stops:
                break
    return gen, lps


def prompt_scores(model, prompt):
    """log_softmax of the model's logits at each prompt position: row j scores token j + 1."""
    with torch.no_grad():
        return torch.log_softmax(model(torch.tensor([list(prompt)])).logits[0].float(), -1)
