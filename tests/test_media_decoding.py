"""Images decoded as transformers decodes them (:mod:`mmzoo.models._media`), mode by mode.

The reference is what a transformers user writes: a file through ``transformers.image_utils.load_image``
(path, or the ``data:`` URL a server receives as bytes), a PIL image object straight into the processor
(its ``convert_to_rgb``), then the processor and ``generate``. Each Pillow mode gets a tiny file with a
transparent region where it has alpha (stored black under it, so that dropping alpha and compositing
onto white differ) and an asymmetric pattern (so that a rotation shows); checked: the processor's
pixel values of mmzoo's prepared request against the processor's on transformers' images, on the tiny
Qwen2-VL and Llava checkpoints; the one warning line on stderr where transformers loses information;
video frames; and the prompt ids, prefill logits and greedy tokens against transformers' class.
"""

from __future__ import annotations

import base64
import re
from pathlib import Path

import numpy as np
import pytest
from PIL import Image, ImageSequence

import mmzoo
import parity
from mmzoo.config import family_class
from mmzoo.models import _media

W, H = 56, 28  # Qwen2-VL takes it unresized (multiples of 28); a 90-degree turn changes its grid
PROMPT = "What is this?"
FAMILIES = {"qwen2_vl": "qwen2_vl_ckpt", "llava": "llava_ckpt"}
PIXELS = {"qwen2_vl": "patches", "llava": "pixel_values"}  # the tower input holding the processor's pixels


def _rgb() -> np.ndarray:
    """An asymmetric [H, W, 3] uint8 pattern: ramps across and down, checkers in blue."""
    y, x = np.mgrid[0:H, 0:W]
    return np.stack([x * 255 // (W - 1), y * 255 // (H - 1), (x // 7 + y // 7) % 2 * 200 + 30], -1).astype(np.uint8)


def _alpha() -> np.ndarray:
    """Transparent columns 14..27 (in Llava's center crop too), half transparent below right of them."""
    a = np.full((H, W), 255, np.uint8)
    a[:, W // 4:W // 2] = 0
    a[H // 2:, W // 2:3 * W // 4] = 128
    return a


def _rgba(opaque: bool = False) -> Image.Image:
    px = np.dstack([_rgb(), np.full((H, W), 255, np.uint8) if opaque else _alpha()])
    px[px[..., 3] == 0, :3] = 0  # black stored under the transparent pixels
    return Image.fromarray(px, "RGBA")


def _palette(transparent: bool) -> Image.Image:
    """16 colours; index 0 (black) only in the transparent region, the transparency entry if ``transparent``."""
    idx = (_rgb()[..., 0] // 64 * 4 + _rgb()[..., 2] // 128 + 1).astype(np.uint8)  # 1..15
    idx[_alpha() == 0] = 0
    img = Image.fromarray(idx, "P")
    img.putpalette([0, 0, 0] + [v for i in range(1, 16) for v in (i * 16, 255 - i * 12, (i * 77) % 256)])
    if transparent:
        img.info["transparency"] = 0
    return img


def _exif6() -> Image.Image:
    img = Image.fromarray(_rgb())
    exif = img.getexif()
    exif[0x0112] = 6  # Orientation: rotate 90 degrees clockwise to view
    img.info["exif"] = exif.tobytes()
    return img


def _frames(rgba: bool) -> list[Image.Image]:
    first = _rgba() if rgba else Image.fromarray(_rgb())
    return [first] + [first.transform(first.size, Image.Transform.AFFINE, (1, 0, -7 * i, 0, 1, 0)) for i in (1, 2)]


_WARN_ALPHA = r"a transparent image \(mode {}\) loses its transparency as transformers drops it: "
_WARN_FIRST = r"an animated {} image is read as its first frame only"
def _png_without_palette() -> bytes:
    """A 4x4 colour-type-3 (palette) PNG with no PLTE chunk, indices 0..15."""
    import struct
    import zlib

    def chunk(kind: bytes, data: bytes) -> bytes:
        return struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))

    rows = b"".join(b"\x00" + bytes(range(4 * r, 4 * r + 4)) for r in range(4))  # filter 0, one byte per pixel
    return (b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", struct.pack(">IIBBBBB", 4, 4, 8, 3, 0, 0, 0))
            + chunk(b"IDAT", zlib.compress(rows)) + chunk(b"IEND", b""))


_WARN_CLIP = r"grayscale image \(mode {}, values .*\) is clipped to 0\.\.255, not scaled"
_WARN_FLOAT = r"a float image \(mode F\) is truncated and clipped"
_WARN_EXIF = r"the image object's EXIF orientation \(6\) is not applied"

# mode -> (the file's name, a function writing it, the warning for the file, for the image object)
CASES = {
    "RGB": ("rgb.png", lambda p: Image.fromarray(_rgb()).save(p), None, None),
    "RGBA": ("rgba.png", lambda p: _rgba().save(p), _WARN_ALPHA.format("RGBA"), None),
    "RGBA_opaque": ("opaque.png", lambda p: _rgba(opaque=True).save(p), None, None),
    "LA": ("la.png", lambda p: _rgba().convert("LA").save(p), _WARN_ALPHA.format("LA"), None),
    "L": ("l.png", lambda p: Image.fromarray(_rgb()).convert("L").save(p), None, None),
    "1": ("bw.png", lambda p: Image.fromarray(_rgb()).convert("1").save(p), None, None),
    "P": ("p.png", lambda p: _palette(False).save(p), None, None),
    # load_image keeps the transparent colour (info["transparency"]): the processor composites it onto white
    "P_trns": ("p_trns.png", lambda p: _palette(True).save(p, transparency=0), None, None),
    "P_trns_gif": ("p_trns.gif", lambda p: _palette(True).save(p, transparency=0), None, None),
    "L_trns": ("l_trns.png", lambda p: Image.fromarray(np.asarray(_rgba().convert("L"))).save(p, transparency=0),
               None, None),
    # a palette's per-entry alpha (tRNS): load_image drops it (Pillow warns that it cannot keep it)
    "P_alpha": ("p_alpha.png", lambda p: _palette(False).save(p, transparency=bytes([0, 128] + [255] * 14)),
                _WARN_ALPHA.format("P with palette alpha"), None),
    # a palette PNG without its palette (no PLTE chunk): Pillow reads grey levels, its transparency check asserts
    "P_no_palette": ("p_no_plte.png", lambda p: p.write_bytes(_png_without_palette()), None, None),
    "CMYK": ("cmyk.jpg", lambda p: Image.fromarray(_rgb()).convert("CMYK").save(p, quality=95), None, None),
    "YCbCr": ("ycbcr.tif", lambda p: Image.fromarray(_rgb()).convert("YCbCr").save(p), None, None),
    "I;16": ("gray16.png", lambda p: Image.fromarray((_rgb()[..., 0].astype(np.uint16) * 257)).save(p),
             _WARN_CLIP.format("I;16"), _WARN_CLIP.format("I;16")),
    "I": ("int32.tif", lambda p: Image.fromarray(_rgb()[..., 1].astype(np.int32) * 40 - 3000).save(p),
          _WARN_CLIP.format("I"), _WARN_CLIP.format("I")),
    "F": ("float.tif", lambda p: Image.fromarray(_rgb()[..., 0].astype(np.float32) * 1.3 - 20.5).save(p),
          _WARN_FLOAT, _WARN_FLOAT),
    "EXIF6": ("exif6.jpg", lambda p: _exif6().save(p, quality=95, exif=_exif6().info["exif"]), None, _WARN_EXIF),
    "GIF": ("anim.gif", lambda p: (f := _frames(False))[0].save(p, save_all=True, append_images=f[1:], duration=100),
            _WARN_FIRST.format("GIF"), None),
    "APNG": ("anim.png", lambda p: (f := _frames(True))[0].save(p, save_all=True, append_images=f[1:], duration=100),
             _WARN_ALPHA.format("RGBA") + ".*" + _WARN_FIRST.format("PNG"), None),
}


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> dict[str, str]:
    root = tmp_path_factory.mktemp("modes")
    out = {}
    for mode, (name, write, _, _) in CASES.items():
        write(root / name)
        with Image.open(root / name) as img:  # the file holds the mode it is named for
            assert img.mode == mode.split("_")[0] or mode in ("EXIF6", "GIF", "APNG"), (mode, img.mode)
        out[mode] = str(root / name)
    return out


@pytest.fixture(scope="module")
def setup(request):
    """family -> (the eager engine, the checkpoint's processor, the checkpoint), built on first use."""
    from transformers import AutoProcessor

    built = {}

    def get(family: str):
        if family not in built:
            ckpt = request.getfixturevalue(FAMILIES[family])
            built[family] = (parity.engine(ckpt, "eager"), AutoProcessor.from_pretrained(ckpt), ckpt)
        return built[family]

    return get


def _chat(processor, kind: str, n: int) -> str:
    content = [{"type": kind}] * n + [{"type": "text", "text": PROMPT}]
    return processor.apply_chat_template([{"role": "user", "content": content}], tokenize=False,
                                         add_generation_prompt=True)


def _mmzoo_pixels(engine, family: str, **media) -> np.ndarray:
    prepared = engine.prepare(mmzoo.Request(prompt=PROMPT, **media))
    return np.concatenate([call.inputs[PIXELS[family]] for call in prepared.media])


def _data_url(path: str) -> str:
    return "data:image/x;base64," + base64.b64encode(Path(path).read_bytes()).decode()


def _warnings(err: str) -> list[str]:
    return [line for line in err.splitlines() if line.startswith("mmzoo: warning: images[0]: ")]


@pytest.mark.filterwarnings("ignore:Palette images with Transparency expressed in bytes")  # transformers' load_image
@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("mode", list(CASES))
def test_pixels_match_transformers(setup, files, family, mode, capsys):
    """The path, the file's bytes and the image object: mmzoo's decoded pixels, and the processor's
    pixel values of its prepared request, equal transformers' on the same input; the warning line."""
    from transformers.image_utils import load_image

    engine, processor, _ = setup(family)
    path, (_, _, file_warning, object_warning) = files[mode], CASES[mode]
    np.testing.assert_array_equal(np.asarray(_media.load_image(path, "images[0]")), np.asarray(load_image(path)))
    capsys.readouterr()
    for item, reference, warning in [
            (path, load_image(path), file_warning),
            (Path(path).read_bytes(), load_image(_data_url(path)), file_warning),  # a server's data: URL
            (Image.open(path), Image.open(path), object_warning)]:  # an image object, into the processor as is
        got = _mmzoo_pixels(engine, family, images=[item])
        want = processor(text=[_chat(processor, "image", 1)], images=[reference], return_tensors="np")["pixel_values"]
        np.testing.assert_array_equal(got, want.reshape(got.shape), err_msg=f"{mode} given as {type(item).__name__}")
        lines = _warnings(capsys.readouterr().err)
        if warning is None:
            assert lines == [], f"{mode} given as {type(item).__name__}"
        else:
            assert len(lines) == 1 and re.search(warning, lines[0]), (mode, type(item).__name__, lines)


def test_video_frames_match_transformers(setup, files, tmp_path, capsys):
    """Frame files (transparent, EXIF-rotated) as transformers' ``load_image`` reads them, and a .gif
    video's frames as pillow composes them, converted as ``load_image`` converts an image object (no
    video decoder is installed for transformers' own path): the video processor's pixel values."""
    from transformers.image_utils import load_image

    engine, processor, _ = setup("qwen2_vl")
    gif = tmp_path / "clip.gif"
    (f := _frames(True))[0].save(gif, save_all=True, append_images=f[1:], duration=100, disposal=2)
    with Image.open(gif) as img:
        gif_frames = [load_image(frame) for frame in ImageSequence.Iterator(img)]
    assert len(gif_frames) == 3
    videos = {"transparent": [files["RGBA"], files["LA"], files["P_trns"]], "rotated": [files["EXIF6"]] * 2}
    for name, frames in videos.items():
        got = _mmzoo_pixels(engine, "qwen2_vl", videos=[frames])
        want = processor.video_processor(videos=[[load_image(p) for p in frames]], return_tensors="np")
        np.testing.assert_array_equal(got, want["pixel_values_videos"], err_msg=name)
        lines = [line for line in capsys.readouterr().err.splitlines() if line.startswith("mmzoo: warning: ")]
        if name == "transparent":  # one line for the video, each mode once; the P frame's colour is dropped too
            assert len(lines) == 1 and lines[0].startswith("mmzoo: warning: videos[0]: "), lines
            for mode in ("RGBA", "LA", "P with a transparent colour"):
                assert re.search(_WARN_ALPHA.format(mode).replace("it: ", "it from a video frame: "), lines[0]), mode
        else:
            assert lines == [], lines
    want = processor.video_processor(videos=[gif_frames], return_tensors="np")["pixel_values_videos"]
    np.testing.assert_array_equal(_mmzoo_pixels(engine, "qwen2_vl", videos=[str(gif)]), want)


TOKEN_FILES = ["RGBA", "P_trns", "LA", "CMYK", "EXIF6"]  # given as paths
TOKEN_OBJECTS = ["RGBA", "P_trns"]  # given as PIL image objects


@pytest.mark.parametrize("family", list(FAMILIES))
def test_tokens_match_transformers(setup, files, family, tmp_path):
    """One request of every file in TOKEN_FILES (as paths) and TOKEN_OBJECTS (as image objects):
    prompt ids, prefill logits and 4 greedy tokens equal transformers' class's on the images
    transformers reads from them (``parity.reference`` reads each back from a lossless RGB PNG)."""
    from transformers.image_transforms import convert_to_rgb
    from transformers.image_utils import load_image

    engine, _, ckpt = setup(family)
    items, seen = [], []
    for i, mode in enumerate(TOKEN_FILES + TOKEN_OBJECTS):
        path = files[mode]
        if i < len(TOKEN_FILES):
            items.append(path)
            image = load_image(path)
        else:
            items.append(Image.open(path))
            image = Image.fromarray(convert_to_rgb(Image.open(path), return_numpy=True))  # the processor's own
        seen.append(str(tmp_path / f"{i}.png"))
        image.save(seen[-1])
    n = len(items)
    ref = parity.reference(ckpt, family_class(family).hf_class, "image", seen, [n], PROMPT, new_tokens=4)[n]
    prepared = engine.prepare(mmzoo.Request(prompt=PROMPT, images=items))
    assert prepared.input_ids.tolist() == ref["ids"]
    np.testing.assert_allclose(engine.executor.prompt_logits(prepared), ref["logits"], atol=1e-4, rtol=0)
    result = engine.generate(mmzoo.Request(prompt=PROMPT, images=items, max_new_tokens=4, ignore_eos=True))
    assert result.token_ids == ref["tokens"]
