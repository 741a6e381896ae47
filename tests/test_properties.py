"""Bad input at scale (hypothesis): request lines, media bytes and embeddings tensors.

Every generated case, placed in a batch before a fixed good request, must end as a result or an
error row (``Result.error``, one line), never another exception; the good request must give the
tokens it gives alone. ``Request.parse`` must refuse bad lines with :class:`MmzooError` only.
Then the Python API's request forms and two threads sharing one engine.

One eager engine (tiny Qwen2-VL, ``max_model_len=128``, 4 slots) serves the whole module; every
request generates a few tokens, so an example takes milliseconds (with one torch thread).
"""

from __future__ import annotations

import io
import math
import struct
import threading
import zlib

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, Phase, event, example, given, settings
from hypothesis import strategies as st
from PIL import Image

import mmzoo
import mmzoo.types
from mmzoo.errors import MmzooError
from mmzoo.fixtures import make_image
from mmzoo.types import Request, Result

MAX_LEN = 128
VOCAB = 704  # the tiny checkpoint's LM vocabulary (checked in the engine fixture)
HIDDEN = 64  # its LM hidden size (checked too): the strategies below are built at import
MERGE = 2  # Qwen2-VL's merge_size: one embedding row per merge**2 grid cells
TEXT_IDS = st.integers(3, 300)  # ordinary BPE pieces: no special or placeholder token
GOOD = {"id": "good", "prompt": "Name a shape.", "max_new_tokens": 3, "ignore_eos": True}
SETTINGS = dict(deadline=None, derandomize=True, database=None,  # no explain phase: its tracing is slow
                phases=[Phase.explicit, Phase.generate, Phase.shrink],
                suppress_health_check=[HealthCheck.function_scoped_fixture, HealthCheck.too_slow,
                                       HealthCheck.data_too_large])


@pytest.fixture(scope="module")
def engine(qwen2_vl_ckpt):
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matmuls: on a busy 2-core machine a second thread makes each step ~100x slower
    try:
        engine = mmzoo.load(qwen2_vl_ckpt, model="qwen2_vl", executor="eager", max_model_len=MAX_LEN, max_batch=4,
                            progress=False)
        assert (engine.model.lm.vocab_size, engine.hidden_size, engine.family.merge_size) == (VOCAB, HIDDEN, MERGE)
        yield engine
    finally:
        torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def good_alone(engine):
    """The good request's token ids when it runs alone."""
    (result,) = engine.generate([dict(GOOD)])
    assert result.error is None and len(result.token_ids) == GOOD["max_new_tokens"]
    return result.token_ids


def check_batch(engine, items: list, good_alone: list[int]) -> list[Result]:
    """``engine.generate(items + [GOOD])``: one result or error row per item, the good one unchanged."""
    results = engine.generate([*items, dict(GOOD)])
    assert isinstance(results, list) and len(results) == len(items) + 1
    for r in results:
        assert isinstance(r, Result)
        if r.error is not None:
            assert isinstance(r.error, str) and r.error.strip() and "\n" not in r.error and r.token_ids == [], r
        else:
            assert 1 <= len(r.token_ids) <= MAX_LEN and all(0 <= t < VOCAB for t in r.token_ids), r
    for r in results[:-1]:  # shown by --hypothesis-show-statistics
        event("ran" if r.error is None else "error row")
    good = results[-1]
    assert good.error is None and good.token_ids == good_alone, (good, [r.error for r in results[:-1]])
    return results


# ----------------------------------------------------------------------------- request lines

# Each field's values as (values the schema accepts, values it must refuse). Values that parse but
# the engine refuses (ids outside the vocabulary, prompts past max_model_len, placeholder tokens
# without media, missing images) are in the first: they must become error rows in generate.

JUNK = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats() | st.text(max_size=5),
                    lambda inner: st.lists(inner, max_size=3) | st.dictionaries(st.text(max_size=3), inner,
                                                                                max_size=2), max_leaves=6)
NON_INT = st.one_of(st.sampled_from(["3", "", "false", "1e3", None, True, False, 2.0, 2.5, math.nan, math.inf,
                                     [2], {"n": 2}]), st.floats(), st.text(max_size=4))
NON_FLOAT = st.sampled_from(["0.5", "", "false", None, True, [0.5], {"t": 1}])
def _unicode(text: str) -> bool:
    try:
        text.encode("utf-8")
        return True
    except UnicodeEncodeError:
        return False


PROMPTS = st.one_of(st.text(max_size=30).filter(_unicode), st.sampled_from([
    "", "Name a shape.", "<|image_pad|>", "<|vision_start|>x<|vision_end|>", "<|video_pad|>", "<|im_end|>",
    "<|im_start|>system\nno", "\x00\x01", "a" * 600, "word " * 150, "\u202e\U0001f600"]))

IMAGE = "<a real image file>"
SMALL_PNG = (lambda buf: (make_image(28, 28, seed=7).save(buf, format="PNG"), buf.getvalue())[1])(io.BytesIO())
REQUEST_FIELDS = {
    "prompt": (PROMPTS, st.one_of(st.integers(), st.none(), st.lists(st.text(max_size=3), max_size=2),
                                  st.binary(max_size=3), st.just("\ud800"), st.just("ok\udfff"))),  # lone surrogates
    "max_new_tokens": (st.one_of(st.integers(1, 4), st.sampled_from([MAX_LEN - 1, MAX_LEN, 10**6, 2**20])),
                       st.one_of(NON_INT, st.sampled_from([0, -1, -2**40, 2**20 + 1, 2**70]))),
    "ignore_eos": (st.booleans(), st.sampled_from(["false", "true", 0, 1, "", None, [True]])),
    "temperature": (st.one_of(st.sampled_from([0, 0.0, 0.5, 1, 1e-320, 1e-40, 1e4]), st.floats(0, 5)),
                    st.one_of(NON_FLOAT, st.sampled_from([math.nan, math.inf, -math.inf, -0.5, -1, 1e30, 1e300]))),
    "top_k": (st.sampled_from([0, 1, 5, VOCAB - 1, VOCAB, 10**6, 2**31]),
              st.one_of(NON_INT, st.sampled_from([-1, -2**70, 2**31 + 1, 2**62, 2**63, 10**30]))),
    "top_p": (st.sampled_from([1, 1.0, 0.5, 1e-300, 5e-324]),
              st.one_of(NON_FLOAT, st.sampled_from([0, 0.0, -0.1, 1.01, math.nan, math.inf]))),
    "seed": (st.one_of(st.none(), st.sampled_from([0, 1, 2**32, 2**64, 2**200])),
             st.one_of(NON_INT.filter(lambda v: v is not None), st.just(-1))),
    "stop_token_ids": (st.lists(st.integers(0, 2 * VOCAB), max_size=3),
                       st.one_of(st.just("12"), st.just(12), st.lists(st.integers(-5, -1), min_size=1, max_size=2),
                                 st.lists(st.sampled_from(["1", 1.5, None]), min_size=1, max_size=2))),
    "id": (st.one_of(st.none(), st.integers(-2**70, 2**70), st.text(max_size=6), st.just("good")),
           st.sampled_from([True, 1.5, [1], {"a": 1}])),
    "prompt_token_ids": (
        st.one_of(st.lists(TEXT_IDS, min_size=1, max_size=20),
                  st.lists(st.integers(0, 2**70), min_size=1, max_size=5),  # mostly outside the vocabulary
                  st.lists(st.sampled_from([676, 677, 678, 679, 680, 681, 682, VOCAB - 1, VOCAB]), min_size=1,
                           max_size=4),  # special and placeholder tokens, the last id, the first past it
                  st.builds(lambda n, t: [t] * n, st.integers(MAX_LEN - 2, 3 * MAX_LEN), TEXT_IDS),
                  st.none()),
        st.one_of(st.just([]), st.just("1 2 3"), st.just(5), st.lists(st.integers(-2**40, -1), min_size=1, max_size=3),
                  st.lists(st.sampled_from(["7", 7.0, None, [7]]), min_size=1, max_size=3))),
    # IMAGE stands for a real image file (replaced in the test); SMALL_PNG is an image's bytes
    "images": (st.sampled_from([[], [IMAGE], [IMAGE, IMAGE], [SMALL_PNG], [b"\x89PNG"], ("missing.png",),
                                ["/nonexistent/x.png"], ["/"], [123], [None], [["nested"]], [{"path": "x"}]]),
               st.sampled_from(["a.png", "", b"a.png", None, 5, {"a": "b"}])),
    # accepted by the schema whatever they hold: checked where the family reads them
    "inputs_embeds": (st.sampled_from([None, [[0.1] * HIDDEN], [[math.nan] * HIDDEN], [[0.1] * (HIDDEN - 1)], [],
                                       "x", [["a"] * HIDDEN], [[0.1] * HIDDEN] * (MAX_LEN + 1),
                                       torch.zeros(3, HIDDEN), torch.full((2, HIDDEN), 3e38),
                                       torch.full((2, HIDDEN), math.inf, dtype=torch.float16)]),
                      None),
}
if "messages" in mmzoo.types.REQUEST_FIELDS:  # a whole conversation instead of prompt
    REQUEST_FIELDS["messages"] = (
        st.one_of(st.none(), st.sampled_from([
            [{"role": "user", "content": "Name a shape."}], [], [{"role": "user"}], [{"role": 1, "content": "x"}],
            [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What?"}]}],
            [{"role": "user", "content": [{"type": "text", "text": 5}]}], [{"role": "user", "content": [5]}],
            [{"role": "user", "content": "<|image_pad|>"}], [{"role": "user", "content": {"text": "x"}}],
            [{"role": "system", "content": "Be brief."}, {"role": "user", "content": [{"type": "text", "text": "Go"}]}],
            [{"role": "user", "content": "\ud800"}],
        ])), st.sampled_from(["hi", [1], ["hi"], {"role": "user"}, [[{"role": "user"}]], 5]))
UNKNOWN_KEYS = st.dictionaries(st.sampled_from(["max_tokens", "Prompt", "images ", "", "best_of", "stream", "__class__"]),
                               JUNK, min_size=1, max_size=2)


@st.composite
def request_lines(draw):
    """``(line, bad)``: a dict of some Request fields (valid or not) and perhaps unknown keys;
    ``bad`` names the keys the schema must refuse (the unknown ones alone when there are any, as
    those are reported first)."""
    names = draw(st.lists(st.sampled_from(sorted(REQUEST_FIELDS)), unique=True, max_size=4))
    refusable = [name for name in names if REQUEST_FIELDS[name][1] is not None]
    bad = refusable[:[0, 0, 0, 1, 1, 2][draw(st.integers(0, 5))]]  # mostly lines the schema accepts
    line = {name: draw(REQUEST_FIELDS[name][name in bad]) for name in names}
    if draw(st.integers(0, 7)) == 0:
        extra = draw(UNKNOWN_KEYS)
        line.update(extra)
        bad = sorted(extra)
    line.setdefault("max_new_tokens", 2)  # keep valid requests short
    return line, bad


VALID_LINES = st.fixed_dictionaries(
    {"max_new_tokens": st.integers(1, 4)},
    optional={"prompt": st.text(max_size=20).filter(lambda s: "<|" not in s), "ignore_eos": st.booleans(),
              "temperature": st.floats(0, 2), "top_k": st.integers(0, 2**62), "top_p": st.floats(0.05, 1),
              "seed": st.integers(0, 2**80), "stop_token_ids": st.lists(TEXT_IDS, max_size=3),
              "id": st.integers(0, 99) | st.text(max_size=4)})
VALID_TOKEN_LINES = st.fixed_dictionaries({"prompt_token_ids": st.lists(TEXT_IDS, min_size=1, max_size=40),
                                           "max_new_tokens": st.integers(1, 4)})
VALID_IMAGE_LINES = st.fixed_dictionaries({"images": st.lists(st.sampled_from([IMAGE, SMALL_PNG]), min_size=1,
                                                                max_size=2),
                                           "max_new_tokens": st.integers(1, 4)},
                                          optional={"prompt": st.text(max_size=20).filter(lambda s: "<|" not in s)})
NOT_A_MAPPING = st.sampled_from([None, 5, 2.5, ["prompt", "hi"], b"hi", ("hi",)])


@settings(max_examples=300, **SETTINGS)
@given(lines=st.lists(request_lines(), min_size=2, max_size=4))
@example(lines=[({"prompt": "hi", "top_k": 10**30, "temperature": 1.0, "max_new_tokens": 2}, ["top_k"])])  # > int64
@example(lines=[({"prompt": "\ud800", "max_new_tokens": 2}, ["prompt"])])  # a lone surrogate (JSON "\ud800")
@example(lines=[({"prompt": "hi", "temperature": 1e300, "seed": 2**200, "top_p": 5e-324, "max_new_tokens": 2},
                 ["temperature"])])
def test_request_lines_end_as_a_result_or_an_error_row(engine, good_alone, image_files, lines):
    for line, bad in lines:
        if isinstance(line.get("images"), list):
            line["images"] = [image_files[0] if item == IMAGE else item for item in line["images"]]
        try:
            Request.parse(line, where="line 1")
        except MmzooError as e:  # only MmzooError may come out; anything else fails the test
            msg = str(e)
            assert bad, f"{line!r} was refused: {msg}"
            assert msg.startswith("line 1: ") and "\n" not in msg
            for key in bad:  # each refused key named: 'key' (unknown), key=value or key[i]=value
                assert repr(key) in msg or f"{key}=" in msg or f"{key}[" in msg, (key, msg)
        else:
            assert not bad, f"{line!r} was accepted"
    results = check_batch(engine, [line for line, _ in lines], good_alone)
    for (line, bad), r in zip(lines, results):
        if bad:
            assert r.error is not None, (line, r)


@settings(max_examples=60, **SETTINGS)
@given(lines=st.lists(st.one_of(VALID_LINES, VALID_TOKEN_LINES, VALID_IMAGE_LINES), min_size=1, max_size=4))
def test_valid_request_lines_all_run(engine, good_alone, image_files, lines):
    for line in lines:
        if "images" in line:
            line["images"] = [image_files[0] if item == IMAGE else item for item in line["images"]]
    results = check_batch(engine, lines, good_alone)
    assert [r.error for r in results] == [None] * len(results)
    for line, r in zip(lines, results):
        assert len(r.token_ids) <= line["max_new_tokens"]
        if "prompt_token_ids" in line:
            assert r.prompt_token_ids == line["prompt_token_ids"]


@settings(max_examples=30, **SETTINGS)
@given(junk=st.lists(NOT_A_MAPPING | JUNK.filter(lambda v: not isinstance(v, (dict, str))), min_size=1, max_size=3))
def test_items_that_are_not_requests_are_error_rows(engine, good_alone, junk):
    results = check_batch(engine, junk, good_alone)
    assert all(r.error for r in results[:-1])


# ----------------------------------------------------------------------------- media bytes

def _encode(img: Image.Image, fmt: str) -> bytes:
    buf = io.BytesIO()
    img.save(buf, format=fmt)
    return buf.getvalue()


def _chunk(kind: bytes, data: bytes) -> bytes:
    return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data) & 0xFFFFFFFF)


def png_claiming(width: int, height: int, color_type: int, body: bytes) -> bytes:
    """A PNG whose (well-formed, CRC-correct) header claims ``width x height``, then ``body``."""
    ihdr = struct.pack(">IIBBBBB", width, height, 8, color_type, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + _chunk(b"IHDR", ihdr) + body


def bmp_claiming(width: int, height: int) -> bytes:
    """A BMP header (24 bit) claiming ``width x height`` (height may be negative: top-down), no pixels."""
    dib = struct.pack("<IiiHHIIiiII", 40, width, height, 1, 24, 0, 0, 2835, 2835, 0, 0)
    return b"BM" + struct.pack("<IHHI", 14 + len(dib), 0, 0, 14 + len(dib)) + dib


def gif_claiming(width: int, height: int) -> bytes:
    return b"GIF89a" + struct.pack("<HHBBB", width, height, 0, 0, 0) + b"\x2c" + struct.pack(
        "<HHHHB", 0, 0, width, height, 0) + b"\x02\x02\x44\x01\x00\x3b"


BASE_PNG = _encode(make_image(40, 32, seed=3), "PNG")
SIDES = st.sampled_from([0, 1, 2, 3, 28, 56, 400, 401, 9000, 20000, 100000, 2**31 - 1])


def _small_images() -> list[bytes]:
    """Small real images of many modes and formats (those Pillow can write)."""
    base = make_image(24, 20, seed=5)
    out = []
    for mode in ("1", "L", "LA", "P", "RGB", "RGBA", "I;16", "I", "F", "CMYK"):
        for fmt in ("PNG", "GIF", "BMP", "TIFF", "JPEG", "WEBP", "ICO"):
            try:
                out.append(_encode(base.convert(mode), fmt))
            except (OSError, ValueError, KeyError):
                continue
    frames = [make_image(24, 20, seed=s) for s in range(3)]
    buf = io.BytesIO()
    frames[0].save(buf, format="GIF", save_all=True, append_images=frames[1:])
    return out + [buf.getvalue(), _encode(make_image(400, 2, seed=1), "PNG"), _encode(make_image(2, 2), "PNG")]


SMALL_IMAGES = _small_images()


@st.composite
def media_bytes(draw):
    kind = draw(st.sampled_from(["random", "truncated", "mutated", "png_header", "bmp_header", "gif_header",
                                 "real", "real"]))
    if kind == "random":
        return draw(st.binary(max_size=300))
    if kind == "truncated":
        return BASE_PNG[:draw(st.integers(0, len(BASE_PNG) - 1))]
    if kind == "mutated":
        data = bytearray(draw(st.sampled_from([BASE_PNG, *SMALL_IMAGES])))
        for _ in range(draw(st.integers(1, 8))):
            data[draw(st.integers(0, len(data) - 1))] = draw(st.integers(0, 255))
        return bytes(data)
    if kind == "png_header":
        w, h = draw(SIDES), draw(SIDES)
        body = draw(st.sampled_from([b"", _chunk(b"IDAT", zlib.compress(b"\x00" * 64)) + _chunk(b"IEND", b""),
                                     b"garbage"]))
        return png_claiming(w, h, draw(st.sampled_from([0, 2, 3, 4, 6, 7])), body)
    if kind == "bmp_header":
        return bmp_claiming(draw(SIDES), draw(SIDES) * draw(st.sampled_from([1, -1])))
    if kind == "gif_header":
        return gif_claiming(min(draw(SIDES), 65535), min(draw(SIDES), 65535))
    return draw(st.sampled_from(SMALL_IMAGES))


@settings(max_examples=200, **SETTINGS)
@given(blobs=st.lists(media_bytes(), min_size=1, max_size=2), suffix=st.sampled_from([".png", ".jpg", ".bin", ""]))
def test_media_bytes_end_as_a_result_or_an_error_row(engine, good_alone, tmp_path_factory, blobs, suffix):
    root = tmp_path_factory.mktemp("media")
    paths = []
    for i, blob in enumerate(blobs):
        path = root / f"item{i}{suffix}"
        path.write_bytes(blob)
        paths.append(str(path))
    items = [{"prompt": "What is it?", "images": [p], "max_new_tokens": 2} for p in paths]
    items += [{"prompt": "What is it?", "images": [blob], "max_new_tokens": 2} for blob in blobs]  # the file's bytes
    items.append({"prompt": "Both?", "images": paths, "max_new_tokens": 2})
    results = check_batch(engine, items, good_alone)
    n = len(blobs)
    for blob, by_path, by_bytes in zip(blobs, results[:n], results[n:2 * n]):
        if blob in SMALL_IMAGES:  # an intact small image of any mode must run
            assert by_path.error is None and by_bytes.error is None, (by_path.error, by_bytes.error)
        assert by_path.token_ids == by_bytes.token_ids  # the same image, from a file or from its bytes


# ----------------------------------------------------------------------------- embeddings tensors

VALUES = st.one_of(st.floats(-4, 4), st.sampled_from([math.nan, math.inf, -math.inf, 3e38, -3e38, 1e30, 0.0]))
FLOAT_DTYPES = st.sampled_from([torch.float32, torch.float64, torch.float16, torch.bfloat16])
DTYPES = st.one_of(FLOAT_DTYPES, st.sampled_from([torch.int64, torch.bool]))
CONTAINERS = st.sampled_from(["tensor", "numpy", "list", "split"])
GRID_INTS = st.sampled_from([-2**31, -1, 0, 1, 2, 3, 4, 2**31, 2**32, 2**62, 2**64])


def _contain(t: torch.Tensor, how: str):
    if how == "numpy" and t.dtype != torch.bfloat16:
        return t.numpy()
    if how == "list":
        return t.tolist()
    if how == "split" and t.dim() == 2 and t.shape[0] > 1:
        return list(torch.split(t, [1, t.shape[0] - 1]))
    return t


@st.composite
def embeddings_cases(draw):
    """``(fields, valid)``: image_embeds (and perhaps image_grid_thw) for a prompt; ``valid`` when
    they are finite floats of the LM's width whose grid implies their row count."""
    well_formed = draw(st.booleans())  # [rows, hidden] floats with a matching grid, perhaps not finite
    ndim = 2 if well_formed else draw(st.integers(0, 3))
    rows = draw(st.sampled_from([1, 2, 3, 5] if well_formed else [0, 1, 2, 3, 5]))
    width = HIDDEN if well_formed else draw(st.sampled_from([HIDDEN, HIDDEN - 1, HIDDEN + 1, 1, 0]))
    shape = [rows, width] if ndim == 2 else draw(st.lists(st.sampled_from([0, 1, 2, HIDDEN]), min_size=ndim,
                                                          max_size=ndim))
    n = int(np.prod(shape)) if shape else 1
    base = draw(st.sampled_from([0.0, 0.5, -1.0]))
    values = torch.full((n,), base, dtype=torch.float64)
    for _ in range(draw(st.integers(0, 3)) if n else 0):
        values[draw(st.integers(0, n - 1))] = draw(VALUES)
    dtype = draw(FLOAT_DTYPES if well_formed else DTYPES)
    t = values.reshape(shape).to(dtype)
    how = draw(CONTAINERS)
    fields = {"image_embeds": _contain(t, how)}
    grid_kind = draw(st.sampled_from(["match", "match_split", "flat"] if well_formed else [
        "match", "match", "match_split", "none", "random", "flat", "bad_shape", "overflow", "junk"]))
    grid_ok = False
    if grid_kind == "match":
        fields["image_grid_thw"] = [[1, MERGE, MERGE * rows]]
        grid_ok = rows > 0
    elif grid_kind == "match_split" and rows >= 2:  # two images: 1 row, then the rest
        fields["image_grid_thw"] = torch.tensor([[1, MERGE, MERGE], [1, MERGE, MERGE * (rows - 1)]])
        grid_ok = True
    elif grid_kind == "random":
        fields["image_grid_thw"] = [[draw(GRID_INTS) for _ in range(3)] for _ in range(draw(st.integers(0, 2)))]
    elif grid_kind == "flat":
        fields["image_grid_thw"] = [1, MERGE, MERGE * max(rows, 1)]
        grid_ok = rows > 0
    elif grid_kind == "bad_shape":
        fields["image_grid_thw"] = draw(st.sampled_from([[], [[1, 2]], [[[1, 2, 2]]], 4, [[1, 2, 2, 1]]]))
    elif grid_kind == "overflow":  # int64 products wrap around: 2**32 * 2**32 * 4 == 0 (mod 2**64)
        fields["image_grid_thw"] = [[1, MERGE, MERGE * max(rows, 1)], [2**32, 2**32, 4]]
    elif grid_kind == "junk":
        fields["image_grid_thw"] = draw(st.sampled_from([[["1", "2", "2"]], [[1, None, 2]], [[1.5, 2, 2]],
                                                         [[1.0, 2.0, 2.0]], "1 2 2", [[True, True, True]]]))
    finite = bool(torch.isfinite(values.to(dtype).to(torch.float64)).all()) if n else True
    valid = (ndim == 2 and rows > 0 and width == HIDDEN and finite and grid_ok
             and dtype in (torch.float32, torch.float64, torch.float16, torch.bfloat16))
    return fields, valid


@settings(max_examples=300, **SETTINGS)
@given(cases=st.lists(embeddings_cases(), min_size=1, max_size=3))
@example(cases=[({"image_embeds": [[0.5] * HIDDEN], "image_grid_thw": [["1", "2", "2"]]}, False)])  # JSON strings
@example(cases=[({"image_embeds": [[0.5] * HIDDEN], "image_grid_thw": [[1, 2, None]]}, False)])  # JSON null
@example(cases=[({"image_embeds": [[0.5] * HIDDEN], "image_grid_thw": [[1, 2, 2**64]]}, False)])  # > int64
@example(cases=[({"image_embeds": [[0.5] * HIDDEN], "image_grid_thw": [[1, 2, 2]]}, True)])  # JSON lists: valid
def test_embeddings_end_as_a_result_or_an_error_row(engine, good_alone, cases):
    items = [{"prompt": "Describe.", "max_new_tokens": 2, **fields} for fields, _ in cases]
    results = check_batch(engine, items, good_alone)
    for (fields, valid), r in zip(cases, results):
        if valid:
            assert r.error is None, r.error
        elif r.error is None:  # only a well-formed case may run: finite, the LM's width, rows as the grid says
            parts = embeds_parts(fields["image_embeds"])
            assert all(p.dim() == 2 and p.shape[0] > 0 and p.shape[1] == HIDDEN and p.is_floating_point()
                       and bool(torch.isfinite(p.double()).all()) for p in parts), fields
            grid = fields.get("image_grid_thw")
            assert grid is not None, fields
            grid = torch.as_tensor(grid).reshape(-1, 3).tolist()
            assert all(v > 0 for row in grid for v in row), grid
            assert sum(math.prod(row) for row in grid) == MERGE**2 * sum(p.shape[0] for p in parts), fields


def embeds_parts(value) -> list[torch.Tensor]:
    """The 2-D parts ``image_embeds`` stands for: a tensor or array, a list of them, a JSON-style list
    of rows (one matrix) or a list of such lists (one matrix each)."""
    if isinstance(value, list) and value and isinstance(value[0], list) and value[0] and isinstance(
            value[0][0], (int, float)):
        value = [value]
    return [torch.as_tensor(np.asarray(p)) if not isinstance(p, torch.Tensor) else p
            for p in (value if isinstance(value, list) else [value])]


# ----------------------------------------------------------------------------- the Python API

def chat_tokens(engine, text: str) -> list[int]:
    ids = engine.processor.apply_chat_template([{"role": "user", "content": [{"type": "text", "text": text}]}],
                                               add_generation_prompt=True, tokenize=True)
    return list(ids[0] if ids and isinstance(ids[0], list) else ids)


def test_a_single_dict_is_one_request(engine):
    r = engine.generate({"prompt": "hi", "max_new_tokens": 3})
    assert isinstance(r, Result) and r.error is None and 1 <= len(r.token_ids) <= 3
    assert r.prompt == "hi" and r.prompt_token_ids == chat_tokens(engine, "hi")
    assert r.prompt_token_ids != chat_tokens(engine, str({"prompt": "hi", "max_new_tokens": 3}))


def test_keywords_are_request_fields_and_sampling_is_reproducible(engine):
    a = engine.generate("hi", temperature=0.5, seed=1, max_new_tokens=3)
    b = engine.generate("hi", temperature=0.5, seed=1, max_new_tokens=3)
    assert isinstance(a, Result) and a.error is None and 1 <= len(a.token_ids) <= 3
    assert a.token_ids == b.token_ids and a.prompt_token_ids == chat_tokens(engine, "hi")


@pytest.mark.parametrize("bad", [{"max_new_tokens": "3"}, {"prompt": "hi", "max_new_tokens": "3"}])
def test_a_single_bad_request_raises_naming_the_field(engine, bad):
    with pytest.raises(MmzooError, match="max_new_tokens"):
        engine.generate(bad)
    with pytest.raises(MmzooError, match="max_new_tokens"):
        engine.generate("hi", max_new_tokens="3")


def test_unknown_fields_are_refused_however_a_request_is_made(engine):
    """``max_tokens`` (the OpenAI name) is not a field: refused, not ignored with the default's 32 tokens."""
    from pydantic import ValidationError

    with pytest.raises(ValidationError, match="max_tokens"):
        Request(prompt="hi", max_tokens=3)
    with pytest.raises(MmzooError, match="unknown field 'max_tokens'"):
        engine.generate("hi", max_tokens=3)
    with pytest.raises(MmzooError, match="unknown field 'max_tokens'"):
        engine.generate({"prompt": "hi", "max_tokens": 3})


# ----------------------------------------------------------------------------- threads

def test_two_threads_on_one_engine_get_their_own_results(engine):
    streams = [[{"prompt": "Name a shape.", "max_new_tokens": 4, "ignore_eos": True},
                {"prompt_token_ids": [11, 42, 97, 230, 301], "max_new_tokens": 3, "ignore_eos": True}],
               [{"prompt": "Count to three.", "temperature": 0.7, "seed": 3, "max_new_tokens": 4, "ignore_eos": True},
                {"prompt_token_ids": [5, 17, 33, 81, 120, 7, 9, 250], "max_new_tokens": 2, "ignore_eos": True}]]
    alone = [[r.token_ids for r in engine.generate(reqs)] for reqs in streams]
    rounds = 4
    barrier = threading.Barrier(2)
    got: list[list] = [[], []]
    errors: list[BaseException] = []

    def worker(k: int) -> None:
        try:
            for _ in range(rounds):
                barrier.wait(timeout=60)
                got[k].append([r.token_ids for r in engine.generate(streams[k])])
        except BaseException as e:  # re-raised below, in the test's thread
            errors.append(e)
            barrier.abort()

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not any(t.is_alive() for t in threads), "generate hung"
    if errors:
        raise errors[0]
    assert got == [[alone[0]] * rounds, [alone[1]] * rounds]
