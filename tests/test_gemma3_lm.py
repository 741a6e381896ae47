"""The ``gemma3`` LM builder against transformers' ``Gemma3ForCausalLM``: a tiny random model with
sliding and full layers (each with its own RoPE), non-trivial ``1 + w`` norms and a sequence longer
than the window; the prompt's logits on every attention backend, and greedy decoding through
mmzoo's KV cache. Also: the Qwen2/Llama builders' parameter names are what they were."""

from __future__ import annotations

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")

import pytest  # noqa: E402
import torch  # noqa: E402

from mmzoo.backends import set_attention  # noqa: E402
from mmzoo.lms import KVCache, gemma3, gemma3_lm_key, llama, qwen2  # noqa: E402

WINDOW = 4
LAYER_TYPES = ["sliding_attention", "full_attention", "sliding_attention", "sliding_attention"]
SIZES = dict(vocab_size=128, dim=64, num_layers=4, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_dim=96)
# small bases, so that 12 positions turn the rotations far enough for a swapped RoPE to show
ROPE = dict(rope_theta=100.0, rope_type="linear", rope_factor=2.0, sliding_rope_theta=10.0, sliding_rope_type="default")
SCALAR = 24  # query_pre_attn_scalar != head_dim: the score scale is its own
PROMPT = [3, 17, 99, 42, 7, 64, 5, 120, 33, 8, 71, 2]  # 12 tokens, three windows


@pytest.fixture(scope="module")
def hf_model():
    """A seeded tiny Gemma3ForCausalLM (eager attention: the reference) with random norm weights."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    config = Gemma3TextConfig(
        vocab_size=SIZES["vocab_size"], hidden_size=SIZES["dim"], intermediate_size=SIZES["intermediate_dim"],
        num_hidden_layers=SIZES["num_layers"], num_attention_heads=SIZES["num_heads"],
        num_key_value_heads=SIZES["num_kv_heads"], head_dim=SIZES["head_dim"], query_pre_attn_scalar=SCALAR,
        sliding_window=WINDOW, layer_types=LAYER_TYPES, max_position_embeddings=64, initializer_range=0.08,
        rope_parameters={"full_attention": {"rope_type": "linear", "factor": ROPE["rope_factor"],
                                            "rope_theta": ROPE["rope_theta"]},
                         "sliding_attention": {"rope_type": "default", "rope_theta": ROPE["sliding_rope_theta"]}},
        tie_word_embeddings=True, eos_token_id=None, pad_token_id=0, bos_token_id=None,
        attn_implementation="eager")
    torch.manual_seed(0)
    model = Gemma3ForCausalLM(config).eval()
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name:  # transformers starts them at zero: (1 + w) == 1 would test nothing
                p.copy_(0.5 * torch.randn(p.shape, generator=g))
    return model


def build(attention: str = "sdpa", **overrides):
    return gemma3(**SIZES, query_pre_attn_scalar=SCALAR, layer_types=LAYER_TYPES, sliding_window=WINDOW,
                  tie_word_embeddings=True, attention=attention, **{**ROPE, **overrides}).eval()


def load(lm, hf_model):
    """transformers' names -> the builder's (``model.`` dropped, :func:`gemma3_lm_key`); strict."""
    state = {gemma3_lm_key(k.removeprefix("model.")): v for k, v in hf_model.state_dict().items()}
    lm.load_state_dict(state, strict=True)
    return lm


def prompt_logits(lm, ids: list[int]) -> torch.Tensor:
    x = torch.tensor([ids])
    positions = torch.arange(len(ids))[None, None]  # [1 axis, b, s]
    with torch.no_grad():
        return lm(lm.embed_tokens(x), positions)[0]  # [s, vocab]


@pytest.fixture(scope="module")
def reference(hf_model):
    with torch.no_grad():
        logits = hf_model(torch.tensor([PROMPT])).logits[0]
        out = hf_model.generate(torch.tensor([PROMPT]), max_new_tokens=6, do_sample=False, output_logits=True,
                                return_dict_in_generate=True)
    return logits, out.sequences[0, len(PROMPT):].tolist(), torch.cat(out.logits)  # [s], [steps], [steps, vocab]


def test_module_layout(hf_model):
    lm = build()
    assert [layer.attn.sliding_window for layer in lm.layers] == [WINDOW, None, WINDOW, WINDOW]
    assert lm.layers[0].attn.scale == SCALAR ** -0.5
    assert lm.embed_tokens.scale == SIZES["dim"] ** 0.5
    assert lm.rotary.num_axes == lm.sliding_rotary.num_axes == 1
    ours = {k for k in lm.state_dict()}
    theirs = {gemma3_lm_key(k.removeprefix("model.")) for k in hf_model.state_dict()}
    assert ours == theirs
    assert tuple(lm.layers[0].attn.q_norm.weight.shape) == (SIZES["head_dim"],)


@pytest.mark.parametrize("attention", ["sdpa", "eager", "pallas"])
def test_prompt_logits_match_transformers(hf_model, reference, attention):
    want = reference[0]
    assert want.std() > 0.3  # logits far from zero: the comparison means something
    got = prompt_logits(load(build(attention), hf_model), PROMPT)
    diff = (got - want).abs().max().item()
    print(f"gemma3 {attention}: max |logit diff| = {diff:.3g}")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_parity_is_sensitive(hf_model, reference):
    """The test above would catch each Gemma 3 specific getting lost: a sliding RoPE equal to the
    full one, an unscaled embedding, the default score scale."""
    lm = load(build(), hf_model)
    base = prompt_logits(lm, PROMPT)
    for name, broken in [("sliding rope", load(build(sliding_rope_theta=ROPE["rope_theta"]), hf_model)),
                         ("rope factor", load(build(rope_type="default", rope_factor=1.0), hf_model))]:
        assert (prompt_logits(broken, PROMPT) - base).abs().max() > 1e-2, name
    lm.embed_tokens.scale = 1.0
    assert (prompt_logits(lm, PROMPT) - base).abs().max() > 1e-2, "embed scale"
    lm.embed_tokens.scale = SIZES["dim"] ** 0.5
    for layer in lm.layers:
        layer.attn.scale = SIZES["head_dim"] ** -0.5
    assert (prompt_logits(lm, PROMPT) - base).abs().max() > 1e-2, "attention scale"


@pytest.mark.parametrize("attention", ["sdpa", "eager", "pallas"])
def test_kv_cache_decode_matches_generate(hf_model, reference, attention):
    """Prefill into slot 0 of mmzoo's KV cache, then one token per step (past the window): the greedy
    tokens of transformers' ``generate``, each step's logits close to its."""
    lm = load(build(attention), hf_model)
    n, steps = len(PROMPT), len(reference[1])
    cache = KVCache(num_layers=SIZES["num_layers"], num_slots=1, num_kv_heads=SIZES["num_kv_heads"],
                    max_len=n + steps, head_dim=SIZES["head_dim"], dtype=torch.float32)
    tokens, step_logits = [], []
    with torch.no_grad():
        pos = torch.arange(n)[None]  # [b, s]
        logits = lm(lm.embed_tokens(torch.tensor([PROMPT])), pos[None], cache=cache.prefill(torch.tensor([0]), pos),
                    logits_index=torch.tensor([n - 1]))  # [1, vocab]
        for i in range(steps):
            tokens.append(int(logits.argmax(-1)))
            step_logits.append(logits)
            if i == steps - 1:
                break
            write = torch.tensor([[n + i]])  # [b, 1]
            logits = lm(lm.embed_tokens(torch.tensor([[tokens[-1]]])), write[None], cache=cache.decode(write),
                        attn_kwargs={"q_positions": write}, logits_index=torch.tensor([0]))
    assert tokens == reference[1]
    assert len(set(tokens)) > 1  # not one token repeated
    diff = (torch.cat(step_logits) - reference[2]).abs().max().item()
    print(f"gemma3 decode {attention}: tokens {tokens}, max |logit diff| = {diff:.3g}")
    torch.testing.assert_close(torch.cat(step_logits), reference[2], atol=1e-4, rtol=0)


def test_tabulated_rotaries_in_an_xla_graph(hf_model, reference):
    """As the XLA executor runs it: both rotaries tabulated (``prepare_model``), the LM traced on the
    XLA device: the same logits."""
    import torch_xla

    lm = load(build("sdpa"), hf_model)
    for rotary in (lm.rotary, lm.sliding_rotary):
        rotary.tabulate(32)
    dev = torch_xla.device()
    lm = lm.to(dev)
    x = torch.tensor([PROMPT], device=dev)
    with torch.no_grad():
        got = lm(lm.embed_tokens(x), torch.arange(len(PROMPT), device=dev)[None, None])[0].cpu()
    torch.testing.assert_close(got, reference[0], atol=1e-4, rtol=0)


def test_final_logit_softcapping():
    lm = build()
    capped = build(final_logit_softcapping=0.5)
    capped.load_state_dict(lm.state_dict())
    hidden = torch.randn(3, SIZES["dim"])
    torch.testing.assert_close(capped.logits(hidden), 0.5 * torch.tanh(lm.logits(hidden) / 0.5))


def test_builder_refuses():
    with pytest.raises(ValueError, match="attn_logit_softcapping=50.0"):
        build(attn_logit_softcapping=50.0)
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        build(rope_type="yarn")
    with pytest.raises(ValueError, match="rope_factor=2.0 needs rope_type='linear'"):
        build(rope_type="default")  # a factor without linear scaling


def test_sliding_window_pattern():
    lm = gemma3(**SIZES, sliding_window=WINDOW, sliding_window_pattern=2)
    assert [layer.attn.sliding_window for layer in lm.layers] == [WINDOW, None, WINDOW, None]


def test_embedding_scale_rounds_to_weight_dtype():
    """As transformers: the factor is cast to the weight's dtype (bfloat16 sqrt(2560) -> 50.5)."""
    from mmzoo.lms import ScaledEmbedding

    emb = ScaledEmbedding(4, 2560, scale=2560 ** 0.5).to(torch.bfloat16)
    with torch.no_grad():
        emb.weight.fill_(1.0)
    assert emb(torch.tensor([0])).float().unique().tolist() == [50.5]


# parameter names of a 1-layer Qwen2 / Llama LM as the builders gave them before the Gemma 3 parameters
# (read off the previous commit's modules): nothing moved
_LLAMA = ["embed_tokens.weight", "layers.0.norm1.weight", "layers.0.attn.q_proj.weight", "layers.0.attn.k_proj.weight",
          "layers.0.attn.v_proj.weight", "layers.0.attn.o_proj.weight", "layers.0.norm2.weight",
          "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
          "norm.weight", "lm_head.weight"]
_QWEN2 = ["embed_tokens.weight", "layers.0.norm1.weight", "layers.0.attn.q_proj.weight", "layers.0.attn.q_proj.bias",
          "layers.0.attn.k_proj.weight", "layers.0.attn.k_proj.bias", "layers.0.attn.v_proj.weight",
          "layers.0.attn.v_proj.bias", "layers.0.attn.o_proj.weight", "layers.0.norm2.weight",
          "layers.0.mlp.gate_proj.weight", "layers.0.mlp.up_proj.weight", "layers.0.mlp.down_proj.weight",
          "norm.weight", "lm_head.weight"]


@pytest.mark.parametrize("builder, want", [(qwen2, _QWEN2), (llama, _LLAMA)])
def test_qwen2_llama_parameter_names_unchanged(builder, want):
    lm = builder(vocab_size=32, dim=16, num_layers=1, num_heads=2, num_kv_heads=1, intermediate_dim=24)
    assert list(lm.state_dict()) == want
    assert type(lm.embed_tokens) is torch.nn.Embedding
    assert lm.sliding_rotary is None and lm.final_logit_softcapping is None
    block = lm.layers[0]
    assert block.post_attn_norm is None and block.post_mlp_norm is None
    assert block.attn.q_norm is None and block.attn.scale == 8 ** -0.5
