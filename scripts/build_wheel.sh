#!/usr/bin/env bash
# Builds the 4bit-forge wheel with the native `forge-rs` binary (crates/forge-cli) as its
# bin/forge-rs, into dist/.
#
# maturin puts a file found in forge._native.data/scripts/ (next to pyproject.toml; checked with
# maturin 1.16, the path stack.md names inside python/ is not picked up) into the wheel's
# <dist>.data/scripts/, which pip installs into the environment's bin/ (notes/stack.md §maturin).
# pyproject.toml also declares a `forge-rs` console script (the fallback for source installs,
# running the same CLI code inside the extension); pip generates console scripts AFTER copying
# data scripts and overwrites same-named files, so this script drops that one entry point from
# the built wheel's entry_points.txt (and fixes RECORD) to keep the native binary.
#
# Usage: scripts/build_wheel.sh [extra maturin build args]
set -euo pipefail
cd "$(dirname "$0")/.."

target_dir=$(cargo metadata --format-version 1 --no-deps | python3 -c 'import json,sys; print(json.load(sys.stdin)["target_directory"])')
cargo build --release --locked -p forge-cli
scripts=forge._native.data/scripts
mkdir -p "$scripts"
install -m 0755 "$target_dir/release/forge-rs" "$scripts/forge-rs"

tmp_out=$(mktemp -d)
trap 'rm -rf "$tmp_out"' EXIT
maturin build --release -o "$tmp_out" "$@"
shopt -s nullglob
built=("$tmp_out"/*.whl)
if [ "${#built[@]}" -ne 1 ]; then
    echo "build_wheel.sh: expected one wheel from maturin, got ${#built[@]}" >&2
    exit 1
fi
mkdir -p dist
wheel="dist/$(basename "${built[0]}")"
mv -f "${built[0]}" "$wheel"

python3 - "$wheel" <<'PY'
"""Drop the `forge-rs` console script from the wheel, check the native binary is in it."""
import base64
import hashlib
import os
import sys
import zipfile

path = sys.argv[1]
with zipfile.ZipFile(path) as z:
    items = [(i, z.read(i.filename)) for i in z.infolist()]
names = [i.filename for i, _ in items]
binary = [n for n in names if n.endswith(".data/scripts/forge-rs")]
if not binary:
    sys.exit(f"build_wheel.sh: {path} has no .data/scripts/forge-rs: {names}")


def digest(data: bytes) -> str:
    return "sha256=" + base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()


out = []
for info, data in items:
    if info.filename.endswith(".dist-info/entry_points.txt"):
        lines = [ln for ln in data.decode().splitlines() if not ln.replace(" ", "").startswith("forge-rs=")]
        data = ("\n".join(lines) + "\n").encode()
    out.append((info, data))
record = next(i for i, _ in out if i.filename.endswith(".dist-info/RECORD"))
rows = []
for info, data in out:
    if info is record:
        rows.append(f"{info.filename},,")
    else:
        rows.append(f"{info.filename},{digest(data)},{len(data)}")
tmp = path + ".tmp"
with zipfile.ZipFile(tmp, "w", zipfile.ZIP_DEFLATED) as z:
    for info, data in out:
        if info is record:
            data = ("\n".join(rows) + "\n").encode()
        z.writestr(info, data)
os.replace(tmp, path)
print(f"{path}: bin/forge-rs is the native binary ({binary[0]})")
PY
