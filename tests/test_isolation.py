"""No request can touch another: a sequence's tokens depend only on its own inputs, whatever ran in
its KV-cache slot before and whatever shares its decode batch.

A slot is poisoned by a write of NaN keys and values at every position of every layer, through
the KV cache's own write path (run on a host copy of the cache, so no graph is compiled; the XLA
executor with a matmul backend holds the keys transposed), or by a request whose embeddings are
huge finite values; then good requests that land in that slot, or decode beside it, must give
exactly the token ids they gave alone on the fresh engine. A prompt does not clear its slot, so
this holds only because the cache stores non-finite values as 0. Each engine serves every test of
its parameters (module fixtures), at a small ``max_model_len`` and a few tokens.

The LMs' RMSNorm (float32 statistics) maps any finite residual to bounded activations, so the huge
request leaves finite keys and values in its slot with these models; the direct poisoning is what
reaches the masked positions.
"""

from __future__ import annotations

import pytest
import torch

import mmzoo
from mmzoo.backends import resolve
from mmzoo.lms import KVCache

MAX_LEN = 64
XLA = dict(buckets={"prefill": [16, 32], "min_decode_kv": 32, "min_encoder_rows": 16, "max_encoder_rows": 16},
           warmup="needed", compile={"on_recompile": "error"}, progress=False)  # needed: what each run hits, then the guard
GEN = {"max_new_tokens": 4, "ignore_eos": True}
# token ids of ordinary pieces (no special or media token): 5 and 12 tokens, both in the 16 bucket,
# so the prompt fills only the start of its slot and decode reads past it
PROMPTS = [[11, 42, 97, 230, 301], [5, 17, 33, 81, 120, 7, 9, 250, 300, 12, 44, 61]]
BACKENDS = ["sdpa", "pallas", "eager"]


def _load(ckpt, executor: str, attention: str, max_batch: int):
    extra = XLA if executor == "xla" else {}
    return mmzoo.load(ckpt, executor=executor, attention=attention, max_batch=max_batch, max_model_len=MAX_LEN,
                      towers=False, **extra)


def _request(ids, **kw):
    return mmzoo.Request(prompt_token_ids=ids, **{**GEN, **kw})


def _tokens(engine, requests) -> list[list[int]]:
    results = engine.generate(requests)
    assert all(r.error is None for r in results), [r.error for r in results]
    if engine.executor.name == "xla":
        assert all(r.graphs_compiled_after_warmup == 0 for r in results)
    return [r.token_ids for r in results]


def poison(executor, slot: int) -> None:
    """What a request whose keys and values turned NaN would leave: NaN written at every position
    of ``slot`` in every layer through :class:`KVCache`'s write path, on a host copy of the cache
    (no graph compiled), then put back on the device."""
    cache = executor.cache
    k0 = cache.k[0]
    host = KVCache(num_layers=len(cache.k), num_slots=cache.num_slots, num_kv_heads=cache.v[0].shape[1],
                   max_len=cache.max_len, head_dim=cache.v[0].shape[3], dtype=k0.dtype,
                   keys_transposed=cache.keys_transposed)
    for held, mine in ((cache.k, host.k), (cache.v, host.v)):
        for t, h in zip(held, mine):
            h.copy_(t.cpu())
    positions = torch.arange(cache.max_len)[None]
    view = host.prefill(torch.tensor([slot]), positions)
    nan = torch.full((1, host.v[0].shape[1], cache.max_len, host.v[0].shape[3]), float("nan"), dtype=k0.dtype)
    for layer in range(len(host.k)):
        view.update(layer, nan, nan)
    for held, mine in ((cache.k, host.k), (cache.v, host.v)):
        for i, (t, h) in enumerate(zip(held, mine)):
            held[i] = h.to(t.device)


def huge_request(engine, **kw):
    """A request whose embeddings are huge finite values (3e38; their squares overflow float32)."""
    return mmzoo.Request(inputs_embeds=torch.full((6, engine.model.lm.dim), 3e38), **{**GEN, **kw})


@pytest.fixture(scope="module", params=[(e, a) for e in ("eager", "xla") for a in BACKENDS],
                ids=lambda p: f"{p[0]}-{p[1]}")
def single(request, qwen2_vl_ckpt):
    """An engine with one slot (every request reuses it) and each prompt's tokens alone on it fresh."""
    executor, attention = request.param
    engine = _load(qwen2_vl_ckpt, executor, attention, max_batch=1)
    if executor == "xla":  # both key layouts are covered: the matmul backends' keys are held transposed
        assert engine.executor.cache.keys_transposed == (attention != "pallas")
    return engine, [_tokens(engine, [_request(p)])[0] for p in PROMPTS]


def test_a_huge_request_does_not_reach_the_next_request(single):
    engine, alone = single
    (huge,) = engine.generate([huge_request(engine)])
    assert huge.error is None and len(huge.token_ids) == GEN["max_new_tokens"]
    assert _tokens(engine, [_request(p) for p in PROMPTS]) == alone


def test_a_poisoned_slot_does_not_reach_the_next_request(single):
    engine, alone = single
    for ids, want in zip(PROMPTS, alone):
        poison(engine.executor, 0)
        assert _tokens(engine, [_request(ids)]) == [want]


@pytest.fixture(scope="module", params=["eager-sdpa", "eager-pallas", "eager-eager", "xla-sdpa", "xla-pallas"])
def batched(request, qwen2_vl_ckpt):
    """An engine with two slots, and each prompt's tokens alone on it fresh (in slot 0)."""
    engine = _load(qwen2_vl_ckpt, *request.param.split("-"), max_batch=2)
    return engine, [_tokens(engine, [_request(p, max_new_tokens=6)])[0] for p in PROMPTS]


def test_a_huge_neighbour_in_the_decode_batch(batched):
    engine, alone = batched
    got = _tokens(engine, [_request(PROMPTS[1], max_new_tokens=6), huge_request(engine, max_new_tokens=2),
                           _request(PROMPTS[0], max_new_tokens=6)])
    assert got[0] == alone[1] and got[2] == alone[0]


def test_a_poisoned_neighbour_in_the_decode_batch(batched, monkeypatch):
    """A long request decodes beside one whose slot turns NaN right after its prefill; the next
    request then takes that slot, beside the long one still decoding."""
    engine, alone = batched
    exe = engine.executor
    prefill = exe.prefill

    def prefill_then_poison(inputs, *args, **kwargs):
        token = prefill(inputs, *args, **kwargs)
        if 1 in inputs.slots[:inputs.count] and not poisoned:
            poison(exe, 1)
            poisoned.append(1)
        return token

    poisoned = []
    monkeypatch.setattr(exe, "prefill", prefill_then_poison)
    long, short, after = _request(PROMPTS[1], max_new_tokens=6), _request(PROMPTS[0], max_new_tokens=2), \
        _request(PROMPTS[0], max_new_tokens=6)
    got = _tokens(engine, [long, short, after])
    assert poisoned == [1]
    assert got[0] == alone[1] and got[2] == alone[0]


# ---------------------------------------------------------------- the backends alone

def _qkv(b=2, hq=4, hkv=2, sq=1, skv=256, d=16, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(b, hq, sq, d, generator=g), torch.randn(b, hkv, skv, d, generator=g),
            torch.randn(b, hkv, skv, d, generator=g))


def _poisoned(x, visible):
    """``x [b, h, s, d]`` with NaN at every key position where ``visible [b, s]`` is False."""
    return torch.where(visible[:, None, :, None], x, torch.full((), float("nan")))


@pytest.mark.parametrize("backend", BACKENDS)
def test_a_row_that_sees_nothing_is_zeros_whatever_the_values(backend):
    """The contract's zeros for a query row with no visible key, chosen by selection: the values
    it does not see (NaN here) never reach it."""
    attn = resolve(backend)
    q, k, v = _qkv()
    lengths = torch.tensor([0, 100])  # row 0 sees nothing
    nan = torch.full_like(k, float("nan"))
    out = attn(q, nan, nan, scale=0.25, kv_lengths=lengths)[0]
    zeros = torch.equal(out, torch.zeros_like(out))
    assert zeros, f"{backend}: {int(out.isnan().sum())} of {out.numel()} outputs NaN"


@pytest.mark.parametrize("sq", [1, 3])
def test_pallas_kernels_select_away_the_keys_no_query_sees(sq):
    """The Pallas kernels (decode for a few queries, flash for more) give the same output whatever
    the keys and values past each sequence's last visible position hold: the KV-cache tile that
    straddles that position is cut by selection, not by zero weights (the dense backends multiply
    such values by zero weights, and rely on the cache never holding another request's values)."""
    from mmzoo.backends import PallasAttention

    attn, attn_flash = PallasAttention(block_kv=128), PallasAttention(block_kv=128, decode_max_q=0)  # flash: always
    q, k, v = _qkv(sq=sq, skv=384)  # three 128-key tiles: sequence 1 reads one whole, one straddling
    pos = torch.tensor([[40 + i for i in range(sq)], [200 + i for i in range(sq)]])
    lengths = torch.tensor([300, 150])  # sequence 0 stops at its position, sequence 1 at its length
    visible = torch.arange(k.shape[2])[None] < torch.minimum(lengths, pos.max(1).values + 1)[:, None]
    for backend in (attn, attn_flash):
        kw = dict(scale=0.25, causal=True, q_positions=pos, kv_lengths=lengths)
        clean = backend(q, k, v, **kw)
        got = backend(q, _poisoned(k, visible), _poisoned(v, visible), **kw)
        same = torch.isfinite(clean).all() and torch.equal(got, clean)
        assert same, f"{backend}: {int((got != clean).sum())} of {got.numel()} outputs changed"


# ---------------------------------------------------------------- the cache alone

@pytest.mark.parametrize("keys_transposed", [False, True], ids=["keys", "keys-transposed"])
def test_the_cache_stores_what_a_prompt_writes_finite_and_leaves_the_rest(keys_transposed):
    """A prompt's write stores NaN and infinities as 0 and touches nothing past the prompt or in
    other slots (no clearing: attention hides the previous sequence's positions)."""
    cache = KVCache(num_layers=2, num_slots=2, num_kv_heads=2, max_len=8, head_dim=4, dtype=torch.float32,
                    keys_transposed=keys_transposed)
    for t in cache.k + cache.v:
        t.fill_(7.0)  # what earlier sequences left
    k = torch.tensor([float("nan"), float("inf"), -float("inf"), 2.0]).expand(1, 2, 3, 4)
    v = torch.tensor([1.0, float("nan"), 3.0, -float("inf")]).expand(1, 2, 3, 4)
    view = cache.prefill(torch.tensor([1]), torch.arange(3)[None])
    for layer in range(2):
        view.update(layer, k, v)
    for layer in range(2):
        keys, values = cache.keys(layer), cache.v[layer]
        assert torch.equal(keys[1, :, :3], torch.tensor([0.0, 0.0, 0.0, 2.0]).expand(2, 3, 4))
        assert torch.equal(values[1, :, :3], torch.tensor([1.0, 0.0, 3.0, 0.0]).expand(2, 3, 4))
        assert (keys[1, :, 3:] == 7).all() and (values[1, :, 3:] == 7).all()
        assert (keys[0] == 7).all() and (values[0] == 7).all()


def _resident(t: torch.Tensor) -> int:
    """Bytes of ``t``'s memory the system has given pages for (``mincore`` over its pages)."""
    import ctypes
    import mmap

    libc = ctypes.CDLL(None, use_errno=True)
    start = t.data_ptr() // mmap.PAGESIZE * mmap.PAGESIZE
    length = t.data_ptr() + t.numel() * t.element_size() - start
    pages = -(-length // mmap.PAGESIZE)
    vec = (ctypes.c_ubyte * pages)()
    if libc.mincore(ctypes.c_void_p(start), ctypes.c_size_t(length), vec) != 0:
        raise OSError(ctypes.get_errno(), "mincore")
    return sum(b & 1 for b in vec) * mmap.PAGESIZE


@pytest.mark.parametrize("keys_transposed", [False, True], ids=["keys", "keys-transposed"])
def test_a_host_cache_takes_memory_as_its_slots_are_written(keys_transposed):
    """On the host, the cache reserves its slots and takes a page of memory when it is first written:
    256 MB reserved, one slot of 8 written 64 positions deep, 1 MB held (keys held transposed: 16.5 MB);
    it holds what was written and reads as zeros elsewhere."""
    layers, slots, heads, max_len, dim = 16, 8, 2, 2048, 128  # 16 x 2 x 8 MB
    cache = KVCache(num_layers=layers, num_slots=slots, num_kv_heads=heads, max_len=max_len, head_dim=dim,
                    dtype=torch.bfloat16, keys_transposed=keys_transposed)
    tensors = cache.k + cache.v
    assert sum(t.numel() * t.element_size() for t in tensors) == 256 * 2 ** 20
    assert sum(_resident(t) for t in tensors) == 0
    k = torch.randn(1, heads, 64, dim).to(torch.bfloat16)
    v = torch.randn(1, heads, 64, dim).to(torch.bfloat16)
    view = cache.prefill(torch.tensor([3]), torch.arange(64)[None])
    for layer in range(layers):
        view.update(layer, k, v)
    # written: 16 layers x 2 heads x 64 positions x 256 B, keys and values = 1 MB in 4 KB pages (a
    # transposed key's 64 positions are in each of its 128 rows: a page each, 16 x 2 x 128 x 4 KB = 16 MB)
    held = sum(_resident(t) for t in tensors)
    assert held == (16.5 if keys_transposed else 1) * 2 ** 20, f"{held / 2 ** 20:.2f} MB of 256 MB"
    for layer in range(layers):
        assert torch.equal(cache.keys(layer)[3, :, :64], k[0]) and torch.equal(cache.v[layer][3, :, :64], v[0])
        assert not cache.keys(layer)[3, :, 64:].any() and not cache.keys(layer)[:3].any()
