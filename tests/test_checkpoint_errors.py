"""Bad input to the quantization run: each case is a clear error naming the file/tensor, through
both `forge.api.quantize_model` and the CLI, and leaves no output that `verify` accepts."""

from __future__ import annotations

import json
import resource
import struct
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file
from tiny_models import make_model, read_tensors

from forge import _native, api, errors

G = 32


@pytest.fixture(scope="module")
def llama(tmp_path_factory) -> Path:
    return make_model("llama", tmp_path_factory.mktemp("src") / "llama", shard="40KB")


def _copy(src: Path, dst: Path) -> Path:
    dst.mkdir(parents=True)
    for f in src.iterdir():
        (dst / f.name).write_bytes(f.read_bytes())
    return dst


def _shards(folder: Path) -> list[Path]:
    return sorted(folder.glob("model-*.safetensors"))


def _header(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    (n,) = struct.unpack("<Q", raw[:8])
    return json.loads(raw[8 : 8 + n]), raw[8 + n :]


def _write_header(path: Path, header: dict, data: bytes) -> None:
    text = json.dumps(header).encode()
    text += b" " * (-len(text) % 8)
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def _no_accepted_output(out: Path) -> None:
    assert not (out / "config.json").exists()
    assert not api.verify(out, raise_on_error=False).ok


def _cli(capfd, *args) -> tuple[int, str, str]:
    """The forge-rs command line, run in-process (the Rust code prints to fds 1 and 2)."""
    capfd.readouterr()
    code = _native.cli_main(["forge-rs", *map(str, args)])
    out, err = capfd.readouterr()
    return code, out, err


def _expect(capfd, src: Path, out: Path, exc, *needles: str, **opts) -> str:
    with pytest.raises(exc) as info:
        api.quantize_model(src, out, group_size=opts.pop("group_size", G), progress=False, **opts)
    msg = str(info.value)
    for n in needles:
        assert n in msg, msg
    _no_accepted_output(out)
    # Same through the command line: one line, exit code 1.
    code, _, err = _cli(capfd, "quantize", src, out.with_name(out.name + "_cli"), "--group-size", G)
    assert code == 1, err
    assert err.startswith("forge-rs: error:") and err.count("\n") == 1, err
    for n in needles:
        assert n in err, err
    _no_accepted_output(out.with_name(out.name + "_cli"))
    return msg


def test_truncated_shard(llama, tmp_path, capfd):
    src = _copy(llama, tmp_path / "src")
    shard = _shards(src)[1]
    raw = shard.read_bytes()
    shard.write_bytes(raw[: len(raw) // 2])
    _expect(capfd, src, tmp_path / "out", errors.CheckpointError, shard.name)


def test_garbage_header(llama, tmp_path, capfd):
    src = _copy(llama, tmp_path / "src")
    shard = _shards(src)[0]
    raw = bytearray(shard.read_bytes())
    raw[8:40] = b"\xff\xfe not json at all \x00\x01" + b"!" * 12
    shard.write_bytes(bytes(raw))
    _expect(capfd, src, tmp_path / "out", errors.CheckpointError, shard.name, "invalid header")


def test_header_length_past_end(llama, tmp_path, capfd):
    src = _copy(llama, tmp_path / "src")
    shard = _shards(src)[0]
    raw = shard.read_bytes()
    shard.write_bytes(struct.pack("<Q", len(raw) * 4) + raw[8:])
    _expect(capfd, src, tmp_path / "out", errors.CheckpointError, shard.name)


def test_offsets_past_the_end(llama, tmp_path, capfd):
    src = _copy(llama, tmp_path / "src")
    shard = _shards(src)[0]
    header, data = _header(shard)
    name = next(k for k in header if k != "__metadata__")
    b, e = header[name]["data_offsets"]
    header[name]["data_offsets"] = [len(data) + 16, len(data) + 16 + (e - b)]
    _write_header(shard, header, data)
    _expect(capfd, src, tmp_path / "out", errors.CheckpointError, shard.name, name)


def test_overlapping_tensors(llama, tmp_path, capfd):
    src = _copy(llama, tmp_path / "src")
    shard = max(_shards(src), key=lambda p: len(_header(p)[0]))
    header, data = _header(shard)
    names = [k for k in header if k != "__metadata__"]
    size = lambda k: header[k]["data_offsets"][1] - header[k]["data_offsets"][0]  # noqa: E731
    small = min(names, key=size)
    big = max(names, key=size)
    begin = header[big]["data_offsets"][0]
    header[small]["data_offsets"] = [begin, begin + size(small)]  # inside `big`, same length
    _write_header(shard, header, data)
    _expect(capfd, src, tmp_path / "out", errors.CheckpointError, shard.name, "overlap")


def test_index_names_missing_file(llama, tmp_path, capfd):
    src = _copy(llama, tmp_path / "src")
    idx_path = src / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    name = sorted(idx["weight_map"])[0]
    idx["weight_map"][name] = "model-00099-of-00099.safetensors"
    idx_path.write_text(json.dumps(idx))
    _expect(capfd, src, tmp_path / "out", errors.CheckpointError, "model-00099-of-00099.safetensors")


def test_index_names_missing_tensor(llama, tmp_path, capfd):
    src = _copy(llama, tmp_path / "src")
    idx_path = src / "model.safetensors.index.json"
    idx = json.loads(idx_path.read_text())
    first_file = sorted(set(idx["weight_map"].values()))[0]
    idx["weight_map"]["model.layers.0.mlp.ghost_proj.weight"] = first_file
    idx_path.write_text(json.dumps(idx))
    _expect(capfd, src, tmp_path / "out", errors.CheckpointError, "model.layers.0.mlp.ghost_proj.weight")


def test_nan_weight_names_tensor_and_position(llama, tmp_path, capfd):
    src = _copy(llama, tmp_path / "src")
    target = "model.layers.1.mlp.down_proj.weight"
    idx = json.loads((src / "model.safetensors.index.json").read_text())
    shard = src / idx["weight_map"][target]
    t = read_tensors(src)
    names = [k for k, f in idx["weight_map"].items() if f == shard.name]
    tensors = {k: t[k].clone() for k in names}
    tensors[target][5, 17] = float("nan")
    save_file(tensors, shard, metadata={"format": "pt"})
    msg = _expect(capfd, src, tmp_path / "out", errors.InvalidValueError, target, "row 5, column 17")
    assert shard.name in msg
    assert isinstance(errors.InvalidValueError("x"), ValueError)


def test_group_size_that_does_not_divide(llama, tmp_path, capfd):
    # hidden 64: every linear reading the hidden state has K = 64, not a multiple of 128.
    with pytest.raises(errors.ShapeError, match=r"in_features 64.*--exclude .*--skip-unpackable"):
        api.quantize_model(llama, tmp_path / "out", group_size=128, progress=False)
    _no_accepted_output(tmp_path / "out")
    code, _, err = _cli(capfd, "quantize", llama, tmp_path / "cli", "--group-size", "128")
    assert code == 1 and "cannot be packed with group size 128" in err
    # Opting in leaves them unquantized and lists them.
    rep = api.quantize_model(llama, tmp_path / "skip", group_size=128, skip_unpackable=True, progress=False)
    api.verify(tmp_path / "skip")
    assert rep.quantized == 2 and any("cannot be packed" in n for n in rep.notes)
    assert "model.layers.0.self_attn.q_proj" in rep.modules_to_not_convert
    with pytest.raises(errors.InvalidValueError, match="group_size"):
        api.quantize_model(llama, tmp_path / "g48", group_size=48, progress=False)
    with pytest.raises(errors.InvalidValueError, match="method"):
        api.quantize_model(llama, tmp_path / "m", method="awq", progress=False)
    with pytest.raises(errors.InvalidValueError, match="calib"):
        api.quantize_model(llama, tmp_path / "m2", method="gptq", group_size=32, progress=False)
    _no_accepted_output(tmp_path / "m2")


def test_already_quantized_source_refused(llama, tmp_path):
    out = tmp_path / "q"
    api.quantize_model(llama, out, group_size=G, progress=False)
    with pytest.raises(errors.CheckpointError, match="already quantized"):
        api.quantize_model(out, tmp_path / "again", group_size=G, progress=False)


def _limit_file_size(limit: int):
    def pre():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return pre


@pytest.mark.parametrize("limit", [30_000])
def test_full_output_disk(llama, tmp_path, limit):
    # A file-size limit stands in for a full disk: the write fails with EFBIG, like ENOSPC.
    out = tmp_path / "out"
    r = subprocess.run(
        [
            sys.executable,
            "-m",
            "forge",
            "quantize",
            str(llama),
            str(out),
            "--group-size",
            str(G),
            "--max-shard-size",
            "200KB",
            "--no-progress",
        ],
        capture_output=True,
        text=True,
        preexec_fn=_limit_file_size(limit),
    )
    assert r.returncode == 1, r.stderr
    assert r.stderr.startswith("forge-rs: error:") and "File too large" in r.stderr, r.stderr
    _no_accepted_output(out)
    # The same through the Python API (in a child, so the limit does not touch pytest).
    code = (
        "import sys\nfrom forge import api\n"
        "try:\n"
        f"    api.quantize_model({str(llama)!r}, {str(tmp_path / 'py')!r}, group_size={G}, "
        "max_shard_size='200KB', progress=False)\n"
        "except OSError as e:\n    print('OSError', e.errno, e); sys.exit(3)\n"
    )
    r = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, preexec_fn=_limit_file_size(limit)
    )
    assert r.returncode == 3 and "OSError 27" in r.stdout, (r.stdout, r.stderr)
    _no_accepted_output(tmp_path / "py")


def test_tensor_dtype_views_are_untouched(llama, tmp_path):
    # Sanity for the fixtures above: the pristine source quantizes and verifies.
    rep = api.quantize_model(llama, tmp_path / "ok", group_size=G, progress=False)
    assert api.verify(tmp_path / "ok").ok and rep.quantized == 14
    assert torch.equal(
        read_tensors(tmp_path / "ok")["model.norm.weight"], read_tensors(llama)["model.norm.weight"]
    )


def test_disk_full_mid_run_on_a_small_tmpfs(tmp_path, capfd, monkeypatch):
    """The free-space check refuses up front; with it skipped, a real ENOSPC in the middle of
    the run (shards are sparse until written) is a clean OSError. Needs mount rights."""
    src = make_model("deepseek", tmp_path / "src")
    mnt = tmp_path / "mnt"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", "size=96k", "tmpfs", str(mnt)], capture_output=True)
    if r.returncode != 0:
        pytest.skip("cannot mount a tmpfs here")
    try:
        out = mnt / "out"
        with pytest.raises(
            errors.CheckpointError, match=r"not enough free space.*FORGE_DISK_CHECK=0"
        ) as info:
            api.quantize_model(src, out, group_size=G, max_shard_size="40KB", progress=False)
        assert str(out) in str(info.value) and "available" in str(info.value)
        assert not any(p.name.endswith(".partial") for p in out.iterdir())
        monkeypatch.setenv("FORGE_DISK_CHECK", "0")
        with pytest.raises(OSError) as info:
            api.quantize_model(src, out, group_size=G, max_shard_size="40KB", progress=False)
        assert info.value.errno == 28 and "No space left" in str(info.value) and ".partial" in str(info.value)
        _no_accepted_output(out)
        code, _, err = _cli(capfd, "quantize", src, mnt / "cli", "--group-size", G)
        assert code == 1 and "No space left on device" in err and err.count("\n") == 1, err
    finally:
        subprocess.run(["umount", str(mnt)], check=False)
