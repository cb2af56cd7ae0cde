"""How a decoder is split, from the plans transformers declares (no process; ``models/plans.py`` and the row
ranges of ``models/row_split.py``)."""
import pytest

from computron.models.plans import check_tp, decoder_plan, part_sizes, tp_sizes_that_work
from computron.models.row_split import block, kv_head_pieces, packed_pieces


def test_llama_plan_from_a_config_json_dict():
    plan = decoder_plan({"model_type": "llama"})
    assert (plan.embeddings, plan.layers, plan.final_norm) == ("embed_tokens", "layers", "norm")
    assert set(plan.colwise) == {"self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "mlp.gate_proj",
                                 "mlp.up_proj"}
    assert set(plan.rowwise) == {"self_attn.o_proj", "mlp.down_proj"}
    assert plan.tp_refusal() is None and plan.packed == () and plan.experts == ()


def test_gather_and_split_styles_map_to_local_columns_and_rows():
    olmo2 = decoder_plan({"model_type": "olmo2"})  # colwise_gather_output / rowwise_split_input
    assert "self_attn.q_proj" in olmo2.colwise and "self_attn.o_proj" in olmo2.rowwise
    qwen3 = decoder_plan({"model_type": "qwen3"})  # per-head norms stay whole
    assert set(qwen3.replicated) == {"self_attn.q_norm", "self_attn.k_norm"}


def test_fused_parts_experts_and_other_layouts():
    phi3 = decoder_plan({"model_type": "phi3"})
    assert dict(phi3.packed) == {"self_attn.qkv_proj": ("q", "kv", "kv"), "mlp.gate_up_proj": ("ffn", "ffn")}
    assert "self_attn.qkv_proj" not in phi3.colwise and "self_attn.o_proj" in phi3.rowwise
    mixtral = decoder_plan({"model_type": "mixtral"})  # transformers 5.25 no longer lists the experts at all
    assert not any("experts" in p for p in mixtral.colwise + mixtral.rowwise + mixtral.replicated)
    assert "self_attn.q_proj" in mixtral.colwise and mixtral.tp_refusal() is None
    neox = decoder_plan({"model_type": "gpt_neox"})
    assert (neox.embeddings, neox.final_norm) == ("embed_in", "final_layer_norm")
    assert "attention.query_key_value" in neox.colwise
    assert decoder_plan({"model_type": "opt"}) is None and decoder_plan({"model_type": "no-such"}) is None


class _MoeConfig:
    """A plan as transformers up to 5.24 declared Mixtral's: experts by path and by style."""
    model_type = "mixtral"
    base_model_pp_plan = {"embed_tokens": (["input_ids"], ["inputs_embeds"]), "layers": (["hidden_states"], []),
                          "norm": (["hidden_states"], ["hidden_states"])}
    base_model_tp_plan = {"layers.*.self_attn.q_proj": "colwise", "layers.*.self_attn.o_proj": "rowwise",
                          "layers.*.mlp.experts.gate_up_proj": "local_packed_rowwise",
                          "layers.*.mlp.experts.down_proj": "local_rowwise", "layers.*.mlp.router": "ep_router"}


def test_experts_stay_whole_whether_named_by_path_or_by_style():
    plan = decoder_plan(_MoeConfig())
    assert plan.experts == ("mlp.experts", "mlp.router")
    assert plan.colwise == ("self_attn.q_proj",) and plan.rowwise == ("self_attn.o_proj",)
    assert plan.tp_refusal() is None


def test_granite_scales_inputs_embeds_again_on_later_stages():
    assert decoder_plan({"model_type": "granite"}).fix.later_stage_scale == ("embedding_multiplier",)


def test_tp_sizes_kv_heads_kept_by_several_ranks():
    wide = {"model_type": "llama", "num_attention_heads": 32, "num_key_value_heads": 8, "intermediate_size": 1024}
    assert tp_sizes_that_work(wide, up_to=32) == [1, 2, 4, 8, 16, 32]
    check_tp(wide, 16, "w")
    smol = {"model_type": "llama", "num_attention_heads": 9, "num_key_value_heads": 3, "intermediate_size": 1536}
    with pytest.raises(ValueError, match=r"model 's': 'llama' model has 9 attention heads, 3 KV heads and "
                                         r"intermediate_size=1536, which tp_world_size=2 cannot split; TP sizes "
                                         r"that work: 1, 3"):
        check_tp(smol, 2, "s")


def test_row_ranges_of_blocks_fused_parts_and_kv_heads():
    assert [block(10, 4, r) for r in range(4)] == [(0, 3), (3, 3), (6, 3), (9, 1)]
    # Phi-3 style: q of 8 rows, k and v of 4 rows each, the second of two ranks
    assert packed_pieces([(8, (block(8, 2, 1),)), (4, (block(4, 2, 1),)), (4, (block(4, 2, 1),))]) == \
        ((4, 4), (10, 2), (14, 2))
    assert part_sizes(("q", "kv", "kv"), {"num_attention_heads": 4, "num_key_value_heads": 2, "hidden_size": 8}) \
        == [8, 4, 4]
    # 2 KV heads of 3 features over 4 ranks: ranks 0 and 1 keep head 0, ranks 2 and 3 head 1
    assert [kv_head_pieces(2, 3, 4, r) for r in range(4)] == [((0, 3),), ((0, 3),), ((3, 3),), ((3, 3),)]
    assert kv_head_pieces(4, 3, 2, 1) == ((6, 6),)
