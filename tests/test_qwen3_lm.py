"""The ``qwen3`` LM builder against transformers: Qwen3-VL's text model (``Qwen3VLTextModel`` of a
tiny random ``Qwen3VLForConditionalGeneration``, its LM head) with interleaved M-RoPE and random
per-head q/k norms, on a prompt whose t/h/w positions differ (a two-frame video-like block), on every
attention backend and through mmzoo's KV cache; the interleaved rotary table itself against
transformers' ``recomposition_frequencies``; and plain Qwen3 (1-D RoPE, ``Qwen3ForCausalLM``).
DeepStack is not part of the LM here (no visual features are added)."""

from __future__ import annotations

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")

import pytest  # noqa: E402
import torch  # noqa: E402

from mmzoo.layers import mrope  # noqa: E402
from mmzoo.lms import KVCache, qwen3  # noqa: E402
from mmzoo.models.family import lm_key  # noqa: E402

SIZES = dict(vocab_size=128, dim=64, num_layers=3, num_heads=4, num_kv_heads=2, head_dim=16, intermediate_dim=96)
SECTIONS = [3, 3, 2]  # head_dim 16: 8 frequencies, interleaved t h w t h w t h (sectioned: t t t h h h w w)
THETA = 100.0  # a small base, so that a frequency read from the wrong axis turns far enough to show
STEPS = 6


def _prompt() -> tuple[list[int], torch.Tensor]:
    """Token ids and ``[3, 1, s]`` t/h/w positions: 4 text tokens, a 2 x 2 x 3 (frames x rows x
    columns) block placed as Qwen2-VL/Qwen3-VL's ``get_rope_index`` places media (every axis starts at
    the text's next position, then t, h, w advance with frame, row, column), then 3 text tokens from
    the block's largest position + 1."""
    t, h, w = [0, 1, 2, 3], [0, 1, 2, 3], [0, 1, 2, 3]
    for f in range(2):
        for r in range(2):
            for c in range(3):
                t.append(4 + f), h.append(4 + r), w.append(4 + c)
    start = max(t + h + w) + 1
    for i in range(3):
        t.append(start + i), h.append(start + i), w.append(start + i)
    ids = [3, 17, 99, 42] + [7 + i for i in range(12)] + [64, 5, 120]
    return ids, torch.tensor([t, h, w])[:, None]  # [3, 1, s]


PROMPT, POSITIONS = _prompt()


def _rename(key: str) -> str | None:
    """A transformers key -> the DecoderLM's, through the compositions' ``lm_key`` unchanged
    (``Qwen3ForCausalLM``'s ``model.*`` read as a VLM's ``model.language_model.*``); None: not the LM's."""
    if key.startswith("model.") and not key.startswith("model.language_model.") and not key.startswith("model.visual"):
        key = "model.language_model." + key.removeprefix("model.")
    new = lm_key(key)
    return None if new is None else new.removeprefix("lm.")


def _lm_state(hf_model) -> dict[str, torch.Tensor]:
    return {new: v for k, v in hf_model.state_dict().items() if (new := _rename(k)) is not None}


def _randomize_norms(model, seed: int) -> None:
    """transformers starts every RMSNorm weight at one: random ones (around 1), so that the q/k
    norms' weights, and each norm's, take part in the comparison."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name and "visual" not in name:
                p.copy_(1.0 + 0.5 * torch.randn(p.shape, generator=g))


@pytest.fixture(scope="module")
def hf_model():
    """A seeded tiny Qwen3VLForConditionalGeneration (eager attention: the reference; a one-block
    ViT that nothing here runs) with an untied LM head and random norm weights."""
    from transformers import Qwen3VLConfig, Qwen3VLForConditionalGeneration

    text = dict(vocab_size=SIZES["vocab_size"], hidden_size=SIZES["dim"], intermediate_size=SIZES["intermediate_dim"],
                num_hidden_layers=SIZES["num_layers"], num_attention_heads=SIZES["num_heads"],
                num_key_value_heads=SIZES["num_kv_heads"], head_dim=SIZES["head_dim"], max_position_embeddings=64,
                initializer_range=0.08, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": THETA, "mrope_section": SECTIONS,
                                 "mrope_interleaved": True})
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=SIZES["dim"],
                  patch_size=2, num_position_embeddings=16, deepstack_visual_indexes=[])
    config = Qwen3VLConfig(text_config=text, vision_config=vision, tie_word_embeddings=False,
                           attn_implementation="eager")
    torch.manual_seed(0)
    model = Qwen3VLForConditionalGeneration(config).eval()
    _randomize_norms(model, seed=1)
    return model


def build(attention: str = "sdpa", **overrides):
    kwargs = dict(SIZES, rope_theta=THETA, mrope_section=SECTIONS, mrope_interleaved=True, attention=attention)
    return qwen3(**{**kwargs, **overrides}).eval()


def load(lm, hf_model):
    lm.load_state_dict(_lm_state(hf_model), strict=True)
    return lm


def prompt_logits(lm, ids: list[int], positions: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return lm(lm.embed_tokens(torch.tensor([ids])), positions)[0]  # [s, vocab]


@pytest.fixture(scope="module")
def reference(hf_model):
    """transformers' prompt logits, then a greedy loop through its own cache (``STEPS`` tokens, each
    decode position the next one on all three axes, as after a media prompt)."""
    from transformers import DynamicCache

    text_model, head = hf_model.model.language_model, hf_model.lm_head
    cache = DynamicCache(config=hf_model.config.text_config)
    with torch.no_grad():
        hidden = text_model(input_ids=torch.tensor([PROMPT]), position_ids=POSITIONS, cache=cache,
                            use_cache=True).last_hidden_state
        logits = head(hidden)[0]  # [s, vocab]
        step, tokens, steps = logits[-1:], [], []
        next_pos = int(POSITIONS.max()) + 1
        for i in range(STEPS):
            tokens.append(int(step.argmax(-1)))
            steps.append(step)
            if i == STEPS - 1:
                break
            pos = torch.full((3, 1, 1), next_pos + i)
            hidden = text_model(input_ids=torch.tensor([[tokens[-1]]]), position_ids=pos, cache=cache,
                                use_cache=True).last_hidden_state
            step = head(hidden)[0]
    return logits, tokens, torch.cat(steps)  # [s, vocab], [steps], [steps, vocab]


# ---------------------------------------------------------------- the rotary table


def _hf_cos_sin(head_dim: int, sections: list[int], positions: torch.Tensor):
    from transformers import Qwen3VLTextConfig
    from transformers.models.qwen3_vl.modeling_qwen3_vl import Qwen3VLTextRotaryEmbedding

    config = Qwen3VLTextConfig(hidden_size=head_dim * 2, num_attention_heads=2, head_dim=head_dim,
                               rope_parameters={"rope_type": "default", "rope_theta": 10000.0,
                                                "mrope_section": sections, "mrope_interleaved": True})
    rotary = Qwen3VLTextRotaryEmbedding(config)
    return rotary(torch.zeros(1, dtype=torch.float32), positions)


@pytest.mark.parametrize("head_dim, sections", [(128, [24, 20, 20]), (16, SECTIONS), (16, [4, 2, 2]), (8, [2, 1, 1])])
def test_interleaved_table_matches_transformers(head_dim, sections):
    """cos/sin of random t/h/w positions: mmzoo's interleaved table (computed and tabulated) equals
    transformers' ``recomposition_frequencies`` (Qwen3-VL-2B's ``[24, 20, 20]`` and tiny ones)."""
    g = torch.Generator().manual_seed(0)
    positions = torch.randint(0, 500, (3, 2, 40), generator=g)  # [3, b, s], the axes unrelated
    want_cos, want_sin = _hf_cos_sin(head_dim, sections, positions)
    rotary = mrope(head_dim, 10000.0, sections, interleaved=True)
    for _ in range(2):  # computed, then tabulated
        cos, sin = rotary(positions)
        torch.testing.assert_close(cos, want_cos, atol=1e-6, rtol=0)
        torch.testing.assert_close(sin, want_sin, atol=1e-6, rtol=0)
        rotary.tabulate(500)
    # the sectioned table (Qwen2-VL's) is a different one: the comparison would see a swap
    cos, _ = mrope(head_dim, 10000.0, sections)(positions)
    assert (cos - want_cos).abs().max() > 0.1


def test_interleaved_axes_table():
    """Qwen3-VL-2B's ``[24, 20, 20]``: 20 rounds of t h w, then four t; the counts per axis are the
    sections. The sectioned table (``interleaved=False``) is what it was."""
    axes = mrope(128, 5e6, [24, 20, 20], interleaved=True).axes
    assert axes.tolist() == [0, 1, 2] * 20 + [0] * 4
    assert torch.bincount(axes).tolist() == [24, 20, 20]
    assert mrope(16, 1e4, SECTIONS, interleaved=True).axes.tolist() == [0, 1, 2, 0, 1, 2, 0, 1]
    assert mrope(16, 1e4, SECTIONS).axes.tolist() == [0, 0, 0, 1, 1, 1, 2, 2]
    assert mrope(128, 1e6, [16, 24, 24]).axes.tolist() == [0] * 16 + [1] * 24 + [2] * 24


def test_interleaved_refuses_sections_that_do_not_fit():
    with pytest.raises(ValueError, match=r"mrope_section \[2, 3, 3\].*head_dim/2 = 8"):
        mrope(16, 1e4, [2, 3, 3], interleaved=True)  # w every 3rd from 2: only 2 of 3 below 8
    with pytest.raises(ValueError, match="sums to 9, expected head_dim/2 = 8"):
        mrope(16, 1e4, [3, 3, 3], interleaved=True)


# ---------------------------------------------------------------- Qwen3-VL's text model


def test_module_layout(hf_model):
    lm = build()
    assert set(lm.state_dict()) == set(_lm_state(hf_model))  # lm_key's renames, nothing else
    block = lm.layers[0]
    assert tuple(block.attn.q_norm.weight.shape) == tuple(block.attn.k_norm.weight.shape) == (SIZES["head_dim"],)
    assert block.attn.qk_norm_per_head and block.attn.q_proj.bias is None and block.attn.o_proj.bias is None
    assert block.post_attn_norm is None and lm.rotary.num_axes == 3
    assert type(lm.embed_tokens) is torch.nn.Embedding and not lm.tie_word_embeddings


@pytest.mark.parametrize("attention", ["sdpa", "eager", "pallas"])
def test_prompt_logits_match_transformers(hf_model, reference, attention):
    want = reference[0]
    assert want.std() > 0.3  # logits far from zero: the comparison means something
    got = prompt_logits(load(build(attention), hf_model), PROMPT, POSITIONS)
    diff = (got - want).abs().max().item()
    print(f"qwen3-vl {attention}: max |logit diff| = {diff:.3g}")
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_parity_is_sensitive(hf_model, reference):
    """The comparison above would catch the sectioned M-RoPE in place of the interleaved one, 1-D
    positions in place of the three axes, and the q/k norms' weights getting lost."""
    want = reference[0]
    sectioned = prompt_logits(load(build(mrope_interleaved=False), hf_model), PROMPT, POSITIONS)
    print(f"qwen3-vl sectioned instead of interleaved: max |logit diff| = {(sectioned - want).abs().max():.3g}")
    assert (sectioned - want).abs().max() > 1e-2, "sectioned M-RoPE"
    lm = load(build(), hf_model)
    flat = POSITIONS[:1].expand(3, -1, -1)  # every axis the temporal one
    assert (prompt_logits(lm, PROMPT, flat) - want).abs().max() > 1e-2, "one position axis"
    with torch.no_grad():
        for layer in lm.layers:
            layer.attn.q_norm.weight.fill_(1.0)
            layer.attn.k_norm.weight.fill_(1.0)
    assert (prompt_logits(lm, PROMPT, POSITIONS) - want).abs().max() > 1e-2, "q/k norm weights"


@pytest.mark.parametrize("attention", ["sdpa", "eager", "pallas"])
def test_kv_cache_decode_matches_transformers(hf_model, reference, attention):
    """Prefill into slot 0 of mmzoo's KV cache at the prompt's t/h/w positions, then one token per
    step at the next position on all three axes (cache rows and rotary positions apart): transformers'
    greedy tokens, each step's logits close to its."""
    lm = load(build(attention), hf_model)
    n, (_, want_tokens, want_logits) = len(PROMPT), reference
    cache = KVCache(num_layers=SIZES["num_layers"], num_slots=1, num_kv_heads=SIZES["num_kv_heads"],
                    max_len=n + STEPS, head_dim=SIZES["head_dim"], dtype=torch.float32)
    next_pos = int(POSITIONS.max()) + 1
    tokens, step_logits = [], []
    with torch.no_grad():
        rows = torch.arange(n)[None]  # [b, s] cache rows
        logits = lm(lm.embed_tokens(torch.tensor([PROMPT])), POSITIONS, cache=cache.prefill(torch.tensor([0]), rows),
                    logits_index=torch.tensor([n - 1]))  # [1, vocab]
        for i in range(STEPS):
            tokens.append(int(logits.argmax(-1)))
            step_logits.append(logits)
            if i == STEPS - 1:
                break
            write = torch.tensor([[n + i]])  # [b, 1] cache row
            rope = torch.full((3, 1, 1), next_pos + i)  # [3, b, 1] rotary positions
            logits = lm(lm.embed_tokens(torch.tensor([[tokens[-1]]])), rope, cache=cache.decode(write),
                        attn_kwargs={"q_positions": write}, logits_index=torch.tensor([0]))
    assert tokens == want_tokens
    assert len(set(tokens)) > 1  # not one token repeated
    diff = (torch.cat(step_logits) - want_logits).abs().max().item()
    print(f"qwen3-vl decode {attention}: tokens {tokens}, max |logit diff| = {diff:.3g}")
    torch.testing.assert_close(torch.cat(step_logits), want_logits, atol=1e-4, rtol=0)


def test_tabulated_rotary_in_an_xla_graph(hf_model, reference):
    """As the XLA executor runs it: the interleaved rotary tabulated, the LM traced on the XLA device."""
    import torch_xla

    lm = load(build("sdpa"), hf_model)
    lm.rotary.tabulate(64)
    dev = torch_xla.device()
    lm = lm.to(dev)
    with torch.no_grad():
        got = lm(lm.embed_tokens(torch.tensor([PROMPT], device=dev)), POSITIONS.to(dev))[0].cpu()
    diff = (got - reference[0]).abs().max().item()
    print(f"qwen3-vl xla (tabulated rotary): max |logit diff| = {diff:.3g}")
    torch.testing.assert_close(got, reference[0], atol=1e-4, rtol=0)


def test_builder_refuses():
    with pytest.raises(ValueError, match=r"mrope_interleaved=True needs mrope_section \(got None\)"):
        build(mrope_section=None)
    with pytest.raises(ValueError, match="rope_type='yarn'"):
        build(rope_type="yarn")


# ---------------------------------------------------------------- plain Qwen3 (1-D RoPE)


@pytest.mark.parametrize("attention_bias, layer_types", [
    (False, None),
    (True, ["full_attention", "sliding_attention", "sliding_attention"]),
])
def test_plain_qwen3_matches_transformers(attention_bias, layer_types):
    """``Qwen3ForCausalLM`` (1-D RoPE; with ``attention_bias``, biases on all four projections; and
    sliding layers over 4 tokens): the same prompt logits, its names through ``lm_key``."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    window = 4 if layer_types else None
    config = Qwen3Config(vocab_size=SIZES["vocab_size"], hidden_size=SIZES["dim"],
                         intermediate_size=SIZES["intermediate_dim"], num_hidden_layers=SIZES["num_layers"],
                         num_attention_heads=SIZES["num_heads"], num_key_value_heads=SIZES["num_kv_heads"],
                         head_dim=SIZES["head_dim"], max_position_embeddings=64, initializer_range=0.08,
                         rope_parameters={"rope_type": "default", "rope_theta": THETA},
                         attention_bias=attention_bias, use_sliding_window=bool(layer_types), sliding_window=window,
                         layer_types=layer_types, tie_word_embeddings=False, attn_implementation="eager")
    torch.manual_seed(2)
    hf = Qwen3ForCausalLM(config).eval()
    _randomize_norms(hf, seed=3)
    if attention_bias:  # transformers starts biases at zero
        g = torch.Generator().manual_seed(4)
        with torch.no_grad():
            for name, p in hf.named_parameters():
                if name.endswith(".bias"):
                    p.copy_(0.1 * torch.randn(p.shape, generator=g))
    lm = qwen3(**SIZES, rope_theta=THETA, attention_bias=attention_bias, layer_types=layer_types,
               sliding_window=window, attention="sdpa").eval()
    assert lm.rotary.num_axes == 1
    lm.load_state_dict(_lm_state(hf), strict=True)
    ids = PROMPT[:12]
    with torch.no_grad():
        want = hf(torch.tensor([ids])).logits[0]
    got = prompt_logits(lm, ids, torch.arange(len(ids))[None, None])
    diff = (got - want).abs().max().item()
    print(f"qwen3 bias={attention_bias} sliding={bool(layer_types)}: max |logit diff| = {diff:.3g}")
    assert want.std() > 0.3
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


@pytest.mark.parametrize("cut", [False, True])
def test_deepstack_matches_transformers(hf_model, cut):
    """DeepStack: features added to the hidden states at the visual positions after the first
    layers (dense zeros elsewhere) give transformers' ``visual_pos_masks`` + ``deepstack_visual_embeds``
    hidden states; with the last layer cut to one position too (3 levels for 3 layers)."""
    ids, positions = PROMPT, POSITIONS
    mask = torch.zeros(1, len(ids), dtype=torch.bool)
    mask[0, 3:9] = True  # six visual positions
    g = torch.Generator().manual_seed(7)
    levels = [torch.randn(int(mask.sum()), SIZES["dim"], generator=g) for _ in range(SIZES["num_layers"])]
    text_model = hf_model.model.language_model
    with torch.no_grad():
        hidden = text_model(input_ids=torch.tensor([ids]), position_ids=positions, visual_pos_masks=mask,
                            deepstack_visual_embeds=levels).last_hidden_state
        want = hf_model.lm_head(hidden)[0]  # [s, vocab]
        plain = hf_model.lm_head(text_model(input_ids=torch.tensor([ids]), position_ids=positions).last_hidden_state)[0]
    dense = torch.zeros(len(levels), 1, len(ids), SIZES["dim"])
    for k, level in enumerate(levels):
        dense[k, mask] = level
    lm = load(build(), hf_model)
    with torch.no_grad():
        x = lm.embed_tokens(torch.tensor([ids]))
        if cut:
            got = lm(x, positions, deepstack=dense, logits_index=torch.tensor([len(ids) - 1]))[0]  # [vocab]
            torch.testing.assert_close(got, want[-1], atol=1e-4, rtol=0)
        else:
            got = lm(x, positions, deepstack=dense)[0]
            torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    assert (want - plain).abs().max() > 1e-2  # the features change the logits
