"""The bundle contract: a typed, sealed, confined manifest, read by one package that the runtime
shares with the exporter, and a runtime that never imports the exporter."""
from __future__ import annotations

import ast
import copy
import hashlib
import json
import os
import random
import subprocess
import sys
from pathlib import Path

import pytest
from helpers import edit_manifest

from mbert.bundle import open_bundle
from mbert.bundle.errors import BundleError
from mbert.bundle.manifest import manifest_digest
from mbert.bundle.names import MANIFEST
from mbert.bundle.paths import check_relpath
from mbert.bundle.schema import from_json

ROOT = Path(__file__).resolve().parent.parent


# --- the runtime never imports the exporter -------------------------------------------------------

def _imports(path: Path) -> list[str]:
    names = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names += [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            names.append(node.module or "")
    return names


def test_no_runtime_module_imports_the_exporter():
    offenders = {p.name: [n for n in _imports(p) if n.startswith("mbert.export")]
                 for p in sorted((ROOT / "runtime").glob("*.py"))}
    offenders = {k: v for k, v in offenders.items() if v}
    assert not offenders, offenders
    assert _imports(ROOT / "export" / "pipeline.py")  # the scan reads real imports


def test_serving_loads_no_exporter_module(bundles):
    code = ("import sys\nfrom mbert.runtime import Encoder\nfrom mbert.runtime.cli import main\n"
            f"enc = Encoder.from_bundle({str(bundles.bundle('mean-fp16'))!r}, precision='fp16')\n"
            "enc.encode(['a text'])\nenc.check_parity(max_len=16)\n"
            "print(sorted(m for m in sys.modules if m.startswith('mbert.export')))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "[]"


# --- sealing and hashing ----------------------------------------------------------------------------

def test_every_file_is_sealed_triton_included(bundles, tmp_path):
    b = bundles.copy("cls", tmp_path / "b")
    files = open_bundle(b).manifest.files
    on_disk = {p.relative_to(b).as_posix() for p in b.rglob("*") if p.is_file()} - {"manifest.json"}
    assert set(files) == on_disk and any(f.startswith("triton/") and f.endswith("model.py") for f in files)
    model_py = next(b / f for f in files if f.startswith("triton/") and f.endswith("model.py"))
    model_py.write_text(model_py.read_text() + "\nimport os  # injected\n")
    with pytest.raises(BundleError, match=r"triton/.*model\.py differs from the file the manifest recorded"):
        open_bundle(b)


def test_an_unlisted_file_is_refused(bundles, tmp_path):
    b = bundles.copy("cls", tmp_path / "b")
    (b / "model.onnx.data").write_bytes(b"weights ONNX Runtime would load beside model.onnx")
    with pytest.raises(BundleError, match=r"model\.onnx\.data is not listed in the manifest"):
        open_bundle(b)


def test_a_bundle_without_its_seal_is_refused(bundles, tmp_path):
    b = bundles.copy("cls", tmp_path / "b")
    edit_manifest(b, lambda m: m.pop("manifest_sha256"), reseal=False)
    with pytest.raises(BundleError, match="manifest_sha256: required key is missing"):
        open_bundle(b)
    edit_manifest(b, lambda m: m.update(manifest_sha256=""), reseal=False)
    with pytest.raises(BundleError, match="the seal is missing"):
        open_bundle(b)


def test_relpath_rules():
    for good in ("model.onnx", "1_Pooling/config.json", "triton/x_onnx/1/model.onnx"):
        assert check_relpath(good, "k") == good
    for bad in ("", "/etc/passwd", "../x", "a/../../b", "a//b", "./a", "a/.", "C:\\x", "a\\b", "x\x00y", 3, None):
        with pytest.raises(BundleError, match=r"^k: "):
            check_relpath(bad, "k")


# --- fuzzing the manifest -------------------------------------------------------------------------

_OUTSIDE = "/etc/passwd"
_BAD_PATHS = ["../../etc/passwd", _OUTSIDE, "a/../../outside/secret.txt", "", "./model.onnx", "x//y", "C:\\Windows",
              "model.onnx/..", "..", "link-out/secret.txt"]


def _nodes(value, path=()):
    """(path, value) of every node of a JSON value, the root excluded."""
    if isinstance(value, dict):
        for k, v in value.items():
            yield (*path, k), v
            yield from _nodes(v, (*path, k))
    elif isinstance(value, list):
        for i, v in enumerate(value):
            yield (*path, i), v
            yield from _nodes(v, (*path, i))


def _set(root, path, value):
    for step in path[:-1]:
        root = root[step]
    root[path[-1]] = value


_PATH_FIELDS = [("graphs", 0, "file"), ("triton", "repository")]
_DICT_FIELDS = {"tool_versions", "labels", "files", "prompts", "per_layer_kind"}  # mappings, not records


def _mutations(raw: dict, rng: random.Random):
    """(description, mutated manifest, the key the error must name, reseal?) tuples."""
    nodes = [(p, v) for p, v in _nodes(raw) if p[0] != "manifest_sha256"]
    for _ in range(60):  # a node of the wrong shape (a scalar where an object goes, an object for a scalar, ...)
        path, value = rng.choice(nodes)
        wrong = "not an object" if isinstance(value, dict) else {"not": "this"} if not isinstance(value, list) \
            else {"not": "a list"}
        m = copy.deepcopy(raw)
        _set(m, path, wrong)
        yield f"wrong type at {path}", m, path, rng.random() < 0.5
    objects = [(p, v) for p, v in _nodes(raw) if isinstance(v, dict) and v] + [((), raw)]
    records = [(p, v) for p, v in objects if not p or p[-1] not in _DICT_FIELDS]  # not a free-form mapping
    for _ in range(40):  # a missing key
        path, value = rng.choice(records)
        key = rng.choice(sorted(value))
        if path == () and key == "manifest_sha256":
            continue
        m = copy.deepcopy(raw)
        target = m
        for step in path:
            target = target[step]
        del target[key]
        yield f"missing {path + (key,)}", m, (*path, key), rng.random() < 0.5
    for _ in range(30):  # an extra key
        path, _value = rng.choice(objects)
        m = copy.deepcopy(raw)
        target = m
        for step in path:
            target = target[step]
        target["unexpected_key"] = {"x": 1}
        yield f"extra key at {path}", m, (*path, "unexpected_key"), rng.random() < 0.5
    for bad in _BAD_PATHS:  # paths out of the folder, in a record and as a files-table key
        for field in _PATH_FIELDS:
            m = copy.deepcopy(raw)
            _set(m, field, bad)
            yield f"path {bad!r} at {field}", m, field, True
        m = copy.deepcopy(raw)
        m["files"][bad] = m["files"].pop("tokenizer.json")
        yield f"files key {bad!r}", m, ("files",), True
    m = copy.deepcopy(raw)
    del m["manifest_sha256"]
    yield "seal dropped", m, ("manifest_sha256",), False
    m = copy.deepcopy(raw)
    m["max_seq_len"] = 64
    yield "value edited without resealing", m, ("manifest_sha256",), False


@pytest.fixture(scope="module")
def audited_opens():
    """Every path opened while ``audited_opens["on"]`` is set (a process-wide audit hook), resolved when
    it is opened (a reader opens its files through the bundle folder it opened: ``/proc/self/fd/N/...``,
    and its manifest relative to that folder's descriptor, which the audit event does not carry: that
    one is kept as the reader's own name for it)."""
    state = {"on": False, "paths": []}

    def hook(event, args):
        if state["on"] and event in ("open", "os.listdir", "os.scandir") and args and isinstance(args[0], (str, bytes, os.PathLike)):
            path = os.fsdecode(args[0])
            state["paths"].append(path if path == MANIFEST else os.path.realpath(path))

    sys.addaudithook(hook)
    return state


def test_fuzzed_manifests_are_refused_naming_the_key_and_read_nothing_outside(bundles, tmp_path, audited_opens):
    root = tmp_path / "fuzz"
    outside = root / "outside"
    outside.mkdir(parents=True)
    (outside / "secret.txt").write_text("secret")
    b = bundles.copy("cls", root / "b")
    (b / "link-out").symlink_to(outside, target_is_directory=True)
    raw = json.loads((b / "manifest.json").read_text())
    secret_entry = {"sha256": hashlib.sha256(b"secret").hexdigest(), "bytes": 6}
    raw["files"]["link-out/secret.txt"] = secret_entry  # a symlinked file made to look sealed
    raw["manifest_sha256"] = manifest_digest(raw)
    with pytest.raises(BundleError):  # pre-import everything open_bundle needs, outside the audit
        open_bundle(b)
    count = 0
    for description, mutated, path, reseal in _mutations(raw, random.Random(8)):
        if reseal:
            mutated["manifest_sha256"] = manifest_digest(mutated)
        (b / "manifest.json").write_text(json.dumps(mutated))
        audited_opens["paths"].clear()
        audited_opens["on"] = True
        try:
            with pytest.raises(BundleError) as err:
                open_bundle(b)
        finally:
            audited_opens["on"] = False
        message = str(err.value)
        named = [str(s) for s in path if not isinstance(s, int)][-1]
        assert named in message or repr(named) in message, (description, message)
        touched = [p for p in audited_opens["paths"] if p != MANIFEST and not Path(p).is_relative_to(b.resolve())]
        assert not touched, (description, touched)
        count += 1
    assert count > 150


def test_a_symlink_leading_out_is_refused_even_when_sealed(bundles, tmp_path):
    b = bundles.copy("cls", tmp_path / "b")
    (tmp_path / "elsewhere.json").write_text((b / "config.json").read_text())
    (b / "config.json").unlink()
    (b / "config.json").symlink_to(tmp_path / "elsewhere.json")
    edit_manifest(b, lambda m: None)
    with pytest.raises(BundleError, match="symbolic link"):
        open_bundle(b)


def test_typed_reading_names_nested_keys():
    from mbert.bundle import Profile

    with pytest.raises(BundleError, match=r"^engine\.profiles\[0\]\.max\[1\]: expected an integer"):
        from_json(tuple[Profile, ...], [{"min": [1, 1], "opt": [1, 1], "max": [1, "x"]}], "engine.profiles")
    with pytest.raises(BundleError, match=r"^p: .*1 <= min <= opt <= max"):
        from_json(Profile, {"min": [2, 1], "opt": [1, 1], "max": [1, 1]}, "p")
    with pytest.raises(BundleError, match=r"^p\.extra: unknown key"):
        from_json(Profile, {"min": [1, 1], "opt": [1, 1], "max": [1, 1], "extra": 1}, "p")
