"""Backend parity: eager, sdpa and pallas agree on every masking rule, on CPU and in an XLA graph.

Eager is the reference; every pair of backends is compared (fp32, atol 1e-5). The cases are a
hand-picked cover of the axes (seq length 1/7/100/1000, head_dim 64/80/128, GQA 1/2/4, causal,
segment ids, kv_lengths, decode against partly filled caches, sliding windows, bidirectional
blocks), not their product, to keep the file short on two cores. The sliding-window and block
cases are checked against the rules written out in float64 (:func:`_reference`).
"""

from __future__ import annotations

import os

os.environ.setdefault("PJRT_DEVICE", "CPU")  # before anything imports torch_xla

import itertools  # noqa: E402
from dataclasses import dataclass  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402
import torch_xla  # noqa: E402

from mmzoo.backends import EagerAttention, PallasAttention, SDPAAttention  # noqa: E402

ATOL = 1e-5


@dataclass(frozen=True)
class Case:
    """One attention call. ``kv_len`` / ``q_pos`` are per-sequence lists; ``segments`` is
    ``"self"`` (one tensor for q and kv, as a vision tower passes), ``"cross"`` (independent
    q and kv ids: some queries see nothing) or None."""

    id: str
    b: int
    hq: int
    hkv: int
    sq: int
    skv: int
    d: int
    causal: bool = False
    segments: str | None = None
    kv_len: tuple[int, ...] | None = None
    q_pos: tuple[tuple[int, ...], ...] | None = None


CASES = [
    # encoders (non-causal, packed images as segments)
    Case("vit-s1000-d80-seg", b=1, hq=4, hkv=4, sq=1000, skv=1000, d=80, segments="self"),
    Case("enc-s7-d64-seg", b=2, hq=2, hkv=2, sq=7, skv=7, d=64, segments="self"),  # flash kernel, one tile
    Case("enc-s1-d128-gqa2", b=2, hq=4, hkv=2, sq=1, skv=1, d=128),
    # prefill
    Case("prefill-s100-d128-gqa4-causal-len", b=2, hq=8, hkv=2, sq=100, skv=100, d=128, causal=True,
         kv_len=(37, 100)),
    Case("prefill-s7-d80-gqa2-causal", b=2, hq=4, hkv=2, sq=7, skv=7, d=80, causal=True),
    Case("prefill-s1000-d64-gqa2-causal-seg", b=1, hq=4, hkv=2, sq=1000, skv=1000, d=64, causal=True,
         segments="self"),
    Case("cross-s100x7-d64-seg-len", b=2, hq=2, hkv=1, sq=100, skv=7, d=64, segments="cross",
         kv_len=(7, 3)),
    # chunked prefill: 100 new tokens at a per-sequence offset in a 1000-row cache
    Case("chunk-s100x1000-d64-gqa2", b=2, hq=4, hkv=2, sq=100, skv=1000, d=64, causal=True,
         q_pos=(tuple(range(0, 100)), tuple(range(600, 700)))),
    # decode against partly filled caches
    Case("decode-sq1-s1000-d128-gqa4", b=3, hq=8, hkv=2, sq=1, skv=1000, d=128, causal=True,
         q_pos=((0,), (417,), (999,))),
    Case("decode-sq3-s100-d80-len", b=2, hq=4, hkv=4, sq=3, skv=100, d=80, causal=True,
         q_pos=((10, 11, 12), (97, 98, 99)), kv_len=(12, 100)),
    Case("decode-sq1-s7-d64-gqa2-len", b=2, hq=4, hkv=2, sq=1, skv=7, d=64, kv_len=(3, 7)),
]


def make_inputs(case: Case, seed: int = 0):
    """q, k, v and the masking kwargs of ``case``, on CPU."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randn(case.b, case.hq, case.sq, case.d, generator=g)
    k = torch.randn(case.b, case.hkv, case.skv, case.d, generator=g)
    v = torch.randn(case.b, case.hkv, case.skv, case.d, generator=g)
    kwargs = {"scale": case.d ** -0.5, "causal": case.causal}
    if case.segments == "self":
        # packed sequences of uneven lengths, ids sorted as a packer writes them
        seg = torch.sort(torch.randint(0, 4, (case.b, case.sq), generator=g), dim=1).values
        kwargs["q_segment_ids"] = kwargs["kv_segment_ids"] = seg
    elif case.segments == "cross":
        kwargs["q_segment_ids"] = torch.randint(0, 3, (case.b, case.sq), generator=g)
        kwargs["kv_segment_ids"] = torch.randint(0, 3, (case.b, case.skv), generator=g)
    if case.kv_len is not None:
        kwargs["kv_lengths"] = torch.tensor(case.kv_len)
    if case.q_pos is not None:
        kwargs["q_positions"] = torch.tensor(case.q_pos)
    return q, k, v, kwargs


def to_device(q, k, v, kwargs, device):
    moved = {n: (t.to(device) if torch.is_tensor(t) else t) for n, t in kwargs.items()}
    if moved.get("q_segment_ids") is not None and kwargs["q_segment_ids"] is kwargs["kv_segment_ids"]:
        moved["kv_segment_ids"] = moved["q_segment_ids"]  # keep "the same tensor" on the device
    return q.to(device), k.to(device), v.to(device), moved


@pytest.fixture(scope="module")
def backends():
    return {"eager": EagerAttention(), "sdpa": SDPAAttention(), "pallas": PallasAttention()}


@pytest.mark.parametrize("device", ["cpu", "xla"])
@pytest.mark.parametrize("case", CASES, ids=lambda c: c.id)
def test_backends_agree(backends, case, device):
    q, k, v, kwargs = to_device(*make_inputs(case), torch_xla.device() if device == "xla" else "cpu")
    outs = {name: fn(q, k, v, **kwargs).cpu() for name, fn in backends.items()}
    for name, out in outs.items():
        assert out.shape == (case.b, case.hq, case.sq, case.d), name
        assert out.dtype == torch.float32, name
    for a, b in itertools.combinations(outs, 2):
        torch.testing.assert_close(outs[a], outs[b], atol=ATOL, rtol=0, msg=lambda m: f"{a} vs {b}: {m}")


@pytest.mark.parametrize("device", ["cpu", "xla"])
def test_windowed_equals_whole_row(backends, device):
    """Prompts of at most ``window`` tokens packed in one row (one crossing a chunk boundary,
    padding in a segment of its own): the windowed form sees the same keys as causal attention
    over the whole row with segment ids, in every backend."""
    lengths, window = [5, 14, 16, 3, 9], 16  # 47 tokens (two prompts cross a window), 17 of padding: 4 windows
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((64 - sum(lengths),), 5)])
    q, k, v, _ = make_inputs(Case("packed", b=1, hq=4, hkv=2, sq=64, skv=64, d=64, causal=True), seed=2)
    kw = {"scale": 0.125, "q_segment_ids": seg[None], "kv_segment_ids": seg[None]}
    dq, dk, dv, dkw = to_device(q, k, v, kw, torch_xla.device() if device == "xla" else "cpu")
    ref = EagerAttention()(q, k, v, causal=True, **kw)
    for name, fn in backends.items():
        out = fn.windowed(dq, dk, dv, window=window, **dkw).cpu()
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0, msg=lambda m: f"{name}: {m}")
    with pytest.raises(ValueError, match="a window of 24 needs one packed row whose length is a multiple of it"):
        backends["sdpa"].windowed(q, k, v, window=24, **kw)


SLIDING = [  # (case, window): prefill with packed prompts, a chunk at an offset, decode
    (Case("slide-prefill-s300-seg-len", b=2, hq=4, hkv=2, sq=300, skv=300, d=64, causal=True, segments="self",
          kv_len=(300, 170)), 50),
    (Case("slide-chunk-s100x1000", b=2, hq=4, hkv=2, sq=100, skv=1000, d=64, causal=True,
          q_pos=(tuple(range(0, 100)), tuple(range(600, 700)))), 130),
    (Case("slide-decode-sq1-s1000-gqa4", b=3, hq=8, hkv=2, sq=1, skv=1000, d=64, causal=True,
          q_pos=((3,), (417,), (999,)), kv_len=(4, 418, 1000)), 200),
]


def _reference(q, k, v, kwargs, window=None):
    """Causal attention written out in float64 from an explicit boolean mask: key ``j`` visible to
    a query at ``p`` iff (``j <= p`` or the two share a bidirectional block: ``q_blocks >= 0`` and
    equal to ``kv_blocks``) and, with a sliding ``window``, ``j > p - window`` (transformers'
    Gemma 3 masks), with the case's lengths and segments. Returns float32 ``[b, hq, sq, d]``."""
    b, hq, sq, d = q.shape
    skv, groups = k.shape[2], hq // k.shape[1]
    pos = kwargs.get("q_positions", torch.arange(sq).expand(b, sq) + (skv - sq))[:, :, None]  # [b, sq, 1]
    j = torch.arange(skv)
    visible = j <= pos  # [b, sq, skv]
    if kwargs.get("q_blocks") is not None:
        q_blk = kwargs["q_blocks"][:, :, None]
        visible |= (q_blk >= 0) & (q_blk == kwargs["kv_blocks"][:, None, :])
    if window is not None:
        visible &= j > pos - window
    if kwargs.get("kv_lengths") is not None:
        visible &= j < kwargs["kv_lengths"][:, None, None]
    if kwargs.get("q_segment_ids") is not None:
        visible &= kwargs["q_segment_ids"][:, :, None] == kwargs["kv_segment_ids"][:, None, :]
    kk, vv = k.double().repeat_interleave(groups, 1), v.double().repeat_interleave(groups, 1)
    scores = (q.double() @ kk.transpose(-1, -2)) * kwargs["scale"]
    scores = scores.masked_fill(~visible[:, None], float("-inf"))
    out = torch.softmax(scores, -1).nan_to_num(0.0) @ vv
    return torch.where(visible.any(-1)[:, None, :, None], out, torch.zeros((), dtype=out.dtype)).float()


@pytest.mark.parametrize("device", ["cpu", "xla"])
@pytest.mark.parametrize("case,window", SLIDING, ids=lambda c: getattr(c, "id", str(c)))
def test_sliding_window(backends, case, window, device):
    """Each backend, Pallas with small tiles too (its tiles below every row's window skipped),
    sees the last ``window`` keys up to each query's own: equal to the rule written out."""
    q, k, v, kwargs = make_inputs(case, seed=3)
    ref = _reference(q, k, v, kwargs, window)
    dq, dk, dv, dkw = to_device(q, k, v, kwargs, torch_xla.device() if device == "xla" else "cpu")
    fns = {**backends, "pallas-tiles": PallasAttention(block_q=64, block_kv=128)}
    for name, fn in fns.items():
        out = fn(dq, dk, dv, sliding_window=window, **dkw).cpu()
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0, msg=lambda m: f"{name}: {m}")
    with pytest.raises(ValueError, match="a sliding window applies to causal attention"):
        backends["eager"](q, k, v, scale=0.1, sliding_window=window)


def test_sliding_window_in_windowed_prefill(backends):
    """The executor's windowed form of packed prompts keeps each key's distance: with a sliding
    window it sees what the whole row does."""
    lengths = [5, 14, 16, 3, 9]
    seg = torch.cat([torch.full((n,), i) for i, n in enumerate(lengths)] + [torch.full((64 - sum(lengths),), 5)])
    q, k, v, _ = make_inputs(Case("packed", b=1, hq=4, hkv=2, sq=64, skv=64, d=64, causal=True), seed=2)
    kw = {"scale": 0.125, "q_segment_ids": seg[None], "kv_segment_ids": seg[None]}
    ref = _reference(q, k, v, kw, 6)
    for name, fn in backends.items():
        out = fn.windowed(q, k, v, window=16, sliding_window=6, **kw)
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0, msg=lambda m: f"{name}: {m}")


def _block_ids(b: int, s: int, runs) -> torch.Tensor:
    """``[b, s]`` block ids: -1 outside, ``runs[i]`` a list of ``(start, stop, id)`` for row ``i``."""
    ids = torch.full((b, s), -1)
    for row, row_runs in enumerate(runs):
        for start, stop, i in row_runs:
            ids[row, start:stop] = i
    return ids


# (case, runs per row, sliding window). With Pallas' small tiles (block_q=64, block_kv=128): in
# "blocks-s300", (50, 90) crosses a q tile, (0, 10) and (290, 300) sit at the ends, and row 1's
# (100, 200) takes the queries 100..127 of q tile 1 past their causal bound (key 127) into kv tile 1,
# which a causal-only skip would miss; its lengths cut that block at 170. In "blocks-packed-seg" two
# prompts (0..139, 140..249) and padding share a row, and block ids restart per prompt: the segment
# rule alone keeps prompt 1's block 0 apart from prompt 0's. "blocks-s8" is short enough for the
# decode kernel, which has no blocks: it takes the flash kernel.
BLOCKS = [
    (Case("blocks-s300-len", b=2, hq=4, hkv=2, sq=300, skv=300, d=64, causal=True, kv_len=(300, 170)),
     [[(0, 10, 0), (50, 90, 1), (120, 140, 2), (290, 300, 3)], [(60, 70, 0), (100, 200, 1)]], None),
    (Case("blocks-s300-len-slide16", b=2, hq=4, hkv=2, sq=300, skv=300, d=64, causal=True, kv_len=(300, 170)),
     [[(0, 10, 0), (50, 90, 1), (120, 140, 2), (290, 300, 3)], [(60, 70, 0), (100, 200, 1)]], 16),
    (Case("blocks-packed-seg", b=1, hq=4, hkv=2, sq=256, skv=256, d=64, causal=True),
     [[(5, 30, 0), (100, 140, 1), (150, 210, 0), (240, 250, 1)]], None),
    (Case("blocks-packed-seg-slide16", b=1, hq=4, hkv=2, sq=256, skv=256, d=64, causal=True),
     [[(5, 30, 0), (100, 140, 1), (150, 210, 0), (240, 250, 1)]], 16),
    (Case("blocks-s8", b=2, hq=4, hkv=2, sq=8, skv=8, d=64, causal=True), [[(2, 6, 0)], [(0, 3, 4), (5, 8, 7)]], None),
]


def _block_inputs(case: Case, runs, seed: int = 4):
    """:func:`make_inputs` plus the blocks of ``runs`` (one tensor for q and kv, as in prefill);
    cases named ``-seg`` pack two prompts and padding as segments 0, 1, 2."""
    q, k, v, kwargs = make_inputs(case, seed=seed)
    kwargs["q_blocks"] = kwargs["kv_blocks"] = _block_ids(case.b, case.sq, runs)
    if "-seg" in case.id:
        seg = torch.cat([torch.zeros(140), torch.ones(110), torch.full((case.sq - 250,), 2)]).long()[None]
        kwargs["q_segment_ids"] = kwargs["kv_segment_ids"] = seg
    return q, k, v, kwargs


def _to_device_blocks(q, k, v, kwargs, device):
    """:func:`to_device`, keeping q and kv blocks one tensor on the device (their memo key)."""
    dq, dk, dv, moved = to_device(q, k, v, kwargs, device)
    moved["kv_blocks"] = moved["q_blocks"]
    return dq, dk, dv, moved


@pytest.mark.parametrize("device", ["cpu", "xla"])
@pytest.mark.parametrize("case,runs,window", BLOCKS, ids=lambda c: getattr(c, "id", None))
def test_bidirectional_blocks(backends, case, runs, window, device):
    """Every backend, Pallas with small tiles too, against the dense float64 rule."""
    q, k, v, kwargs = _block_inputs(case, runs)
    ref = _reference(q, k, v, kwargs, window)
    dq, dk, dv, dkw = _to_device_blocks(q, k, v, kwargs, torch_xla.device() if device == "xla" else "cpu")
    extra = {} if window is None else {"sliding_window": window}
    fns = {**backends, "pallas-tiles": PallasAttention(block_q=64, block_kv=128)}
    for name, fn in fns.items():
        out = fn(dq, dk, dv, **dkw, **extra).cpu()
        torch.testing.assert_close(out, ref, atol=ATOL, rtol=0, msg=lambda m: f"{name}: {m}")
    # the blocks matter: without them the output differs
    plain = {n: t for n, t in kwargs.items() if n not in ("q_blocks", "kv_blocks")}
    assert (_reference(q, k, v, plain, window) - ref).abs().max() > 1e-2


def test_blocks_are_refused_where_meaningless(backends):
    q, k, v, kwargs = _block_inputs(*BLOCKS[0][:2])
    blk = kwargs["q_blocks"]
    for name, fn in backends.items():
        with pytest.raises(ValueError, match="q_blocks/kv_blocks open blocks of causal attention"):
            fn(q, k, v, scale=0.1, q_blocks=blk, kv_blocks=blk)
        with pytest.raises(ValueError, match="pass both q_blocks and kv_blocks, or neither"):
            fn(q, k, v, scale=0.1, causal=True, q_blocks=blk)
        with pytest.raises(ValueError, match="pass both q_blocks and kv_blocks, or neither"):
            fn(q, k, v, scale=0.1, causal=True, kv_blocks=blk)
        with pytest.raises(ValueError, match=r"q_blocks\(2, 299\) and kv_blocks\(2, 300\) must be \[b, sq\] = "
                                             r"\(2, 300\) and \[b, skv\] = \(2, 300\)"):
            fn(q, k, v, scale=0.1, causal=True, q_blocks=blk[:, 1:], kv_blocks=blk)
    seg = torch.zeros(1, 64, dtype=torch.long)
    q, k, v, _ = make_inputs(Case("packed", b=1, hq=4, hkv=2, sq=64, skv=64, d=64, causal=True))
    for name, fn in backends.items():
        with pytest.raises(ValueError, match="windowed form of packed prompts cannot honour q_blocks/kv_blocks"):
            fn.windowed(q, k, v, scale=0.1, window=16, q_segment_ids=seg, kv_segment_ids=seg,
                        q_blocks=seg, kv_blocks=seg)


def test_block_mask_memo_per_forward():
    """Layers of one forward pass the same block tensors: the folded mask is built once; other
    block tensors (or none) build another."""
    q, k, v, kwargs = _block_inputs(*BLOCKS[0][:2])
    eager = EagerAttention()
    args = {n: kwargs.get(n) for n in ("q_segment_ids", "kv_segment_ids", "q_positions", "kv_lengths")}
    first = eager.folded_mask(q, k, causal=True, **args, q_blocks=kwargs["q_blocks"], kv_blocks=kwargs["kv_blocks"])
    again = eager.folded_mask(q, k, causal=True, **args, q_blocks=kwargs["q_blocks"], kv_blocks=kwargs["kv_blocks"])
    assert again is first
    other = kwargs["q_blocks"].clone()
    assert eager.folded_mask(q, k, causal=True, **args, q_blocks=other, kv_blocks=other) is not first
    assert not torch.equal(eager.folded_mask(q, k, causal=True, **args), first)


def test_blocks_xla_graph_is_reused(backends):
    """With blocks, a second call of the same shapes compiles no new graph (sdpa's mask, Pallas'
    flash kernel with its per-tile bound)."""
    import torch_xla.debug.metrics as met

    q, k, v, kwargs = _block_inputs(*BLOCKS[-1][:2])
    for name in ("sdpa", "pallas"):
        compiles = None
        for _ in range(2):  # new device tensors each time, as each forward brings
            dq, dk, dv, dkw = _to_device_blocks(q, k, v, kwargs, torch_xla.device())
            backends[name](dq, dk, dv, **dkw).cpu()
            compiles, before = met.metric_data("CompileTime")[0], compiles
        assert compiles == before, name


def test_small_blocks_match_eager():
    """Many q and kv tiles, padding in both and skipped causal blocks, at a small size."""
    case = Case("tiles", b=2, hq=4, hkv=2, sq=300, skv=300, d=64, causal=True, segments="self",
                kv_len=(300, 170))
    q, k, v, kwargs = make_inputs(case, seed=1)
    ref = EagerAttention()(q, k, v, **kwargs)
    out = PallasAttention(block_q=64, block_kv=128)(q, k, v, **kwargs)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


@pytest.mark.parametrize("device", ["cpu", "xla"])
def test_fully_masked_rows_are_zero(backends, device):
    # sequence 0: an empty cache (kv_lengths 0); sequence 1: queries whose segment id no key has
    q, k, v, _ = make_inputs(Case("masked", b=2, hq=2, hkv=1, sq=5, skv=20, d=64))
    q_seg = torch.tensor([[0, 0, 0, 0, 0], [1, 9, 1, 9, 9]])
    kv_seg = torch.ones(2, 20, dtype=torch.long)
    kwargs = {"scale": 0.125, "q_segment_ids": q_seg, "kv_segment_ids": kv_seg, "kv_lengths": torch.tensor([0, 20])}
    dev = torch_xla.device() if device == "xla" else "cpu"
    sees_nothing = torch.tensor([[1, 1, 1, 1, 1], [0, 1, 0, 1, 1]], dtype=torch.bool)  # [b, sq]
    rows = sees_nothing[:, None, :].expand(2, 2, 5)  # [b, hq, sq]
    for name, fn in backends.items():
        dq, dk, dv, dkw = to_device(q, k, v, kwargs, dev)
        out = fn(dq, dk, dv, **dkw).cpu()
        assert torch.equal(out[rows], torch.zeros(int(rows.sum()), 64)), name
        assert (out[~rows].abs().sum(-1) > 0).all(), name


def test_decode_ignores_cache_past_length():
    """Stale cache rows past each sequence's position get exactly zero weight, even when huge.

    (Finite garbage: like eager, the kernel multiplies masked values by a zero weight, so NaN
    would propagate; mmzoo's cache is zero-initialized.)"""
    q, k, v, kwargs = make_inputs(Case("dec", b=2, hq=4, hkv=2, sq=1, skv=600, d=64, causal=True,
                                       q_pos=((99,), (550,))))
    ref = EagerAttention()(q, k, v, **kwargs)
    k[0, :, 100:], v[0, :, 100:] = 1e6, -1e6  # row 0: stale rows in the tile holding its keys
    k[1, :, 551:], v[1, :, 551:] = 1e6, -1e6  # row 1: and in a second tile
    out = PallasAttention()(q, k, v, **kwargs)
    torch.testing.assert_close(out, ref, atol=ATOL, rtol=0)


def test_check_shape():
    p = PallasAttention()
    p.check_shape(head_dim=80, num_heads=16, num_kv_heads=2)  # fits
    with pytest.raises(ValueError, match="head_dim=4096 needs about .* MiB of VMEM"):
        p.check_shape(head_dim=4096, num_heads=8, num_kv_heads=8)
    with pytest.raises(ValueError, match="decode tile of 16384 query rows"):
        p.check_shape(head_dim=128, num_heads=1024, num_kv_heads=1)
    with pytest.raises(ValueError, match="not a multiple of num_kv_heads"):
        p.check_shape(head_dim=64, num_heads=6, num_kv_heads=4)
    # the VMEM limit is the kernel's, not a fixed number: a larger budget takes the big head_dim
    PallasAttention(vmem_limit_bytes=512 << 20).check_shape(head_dim=4096, num_heads=8, num_kv_heads=8)


def test_constructor_checks():
    with pytest.raises(ValueError, match="block_kv=100 must be a positive multiple of 128"):
        PallasAttention(block_kv=100)
    with pytest.raises(ValueError, match="block_q=12 must be a positive multiple of 8"):
        PallasAttention(block_q=12)
    with pytest.raises(ValueError, match="interpret=False needs a TPU"):
        PallasAttention(interpret=False)
    assert PallasAttention().interpret  # off a TPU: interpret mode, chosen at construction


def test_xla_graph_is_reused():
    """A second call with the same shapes neither re-lowers the kernel nor compiles a graph."""
    import torch_xla.debug.metrics as met

    p = PallasAttention()
    q, k, v, kwargs = to_device(*make_inputs(Case("reuse", b=2, hq=4, hkv=2, sq=1, skv=7, d=64, causal=True,
                                                  q_pos=((2,), (6,)))), torch_xla.device())
    p(q, k, v, **kwargs).cpu()
    compiles = met.metric_data("CompileTime")[0]
    p(q, k, v, **kwargs).cpu()
    assert met.metric_data("CompileTime")[0] == compiles


def test_torch_xla_flash_is_taken_only_where_exact():
    takes = PallasAttention._xla_flash_takes
    seg = torch.zeros(1, 1024, dtype=torch.long)
    assert takes(8, 8, 1024, 1024, None, None, None, None)
    assert takes(8, 8, 1024, 1024, None, None, seg, seg)  # self-attention segments
    assert not takes(8, 8, 1024, 1024, None, None, seg, seg.clone())  # a query may see nothing
    assert not takes(8, 2, 1024, 1024, None, None, None, None)  # GQA
    assert not takes(8, 8, 1000, 1000, None, None, None, None)  # would pad keys unmasked
    assert not takes(8, 8, 640, 640, None, None, None, None)
    assert not takes(8, 8, 128, 1024, None, None, None, None)  # causal alignment differs
    assert not takes(8, 8, 1024, 1024, seg, None, None, None)  # positions
    assert not takes(8, 8, 1024, 1024, None, torch.ones(1), None, None)  # lengths
