"""A bundle's Triton repository as a server runs it: a private serving copy of the verified bundle's
repository (the sealed bundle is never modified), its ensembles and the models they use, and the
encoder an ensemble routes to."""
from __future__ import annotations

from pathlib import Path

from mbert.bundle import Bundle
from mbert.bundle.errors import BundleError
from mbert.bundle.files import link_tree
from mbert.bundle.names import TRITON_CONFIG, TRITON_ENCODERS


def repository_of(bundle: Bundle) -> Path:
    """The Triton repository of an opened (verified) bundle: a tampered repository was refused like any
    other bundle file."""
    if bundle.manifest.triton is None:
        raise BundleError(f"{bundle.path}: the bundle has no Triton repository; re-export it with this mbert-export")
    return bundle.path_of(bundle.manifest.triton.repository, "triton.repository")


def serving_copy(bundle: Bundle, encoder: str | None, into: Path) -> Path:
    """A copy of the opened ``bundle``'s Triton repository in the folder ``into`` (whose ensembles route
    to ``encoder`` when given). Model configs are copied; every other file is hard-linked from the
    folder that was opened and verified (copied where ``into`` is on another file system), so the
    server runs exactly that bundle even when an export replaces it meanwhile, nothing Triton writes
    (the Python backend's ``__pycache__``) lands in the sealed bundle, and an encoder switch never
    modifies it."""
    repository = repository_of(bundle)
    copy = Path(into) / repository.name
    link_tree(repository, copy, copied=(TRITON_CONFIG,))
    if encoder is not None:
        set_ensemble_encoder(copy, encoder)
    return copy


def _parse_config(path: Path):
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2

    try:
        return text_format.Parse(path.read_text(encoding="utf-8"), model_config_pb2.ModelConfig())
    except (OSError, text_format.ParseError) as exc:
        raise BundleError(f"{path}: not a readable Triton model config ({exc})") from exc


def ensembles(repository: Path, unreadable: list[str] | None = None) -> dict[str, list[str]]:
    """Ensemble name -> the models of its steps, for every ensemble of a repository. Configs that
    do not parse raise, or are skipped with their error appended to ``unreadable`` if given."""
    out = {}
    for path in sorted(repository.glob(f"*/{TRITON_CONFIG}")):
        try:
            config = _parse_config(path)
        except BundleError as exc:
            if unreadable is None:
                raise
            unreadable.append(str(exc))
            continue
        if config.platform == "ensemble":
            out[config.name] = [s.model_name for s in config.ensemble_scheduling.step]
    return out


def ensemble_models(repository: Path, unreadable: list[str] | None = None) -> list[str]:
    """The ensembles of a repository and the models their steps use: what ``mbert-run serve``
    loads (a model of a backend this server lacks is never tried unless an ensemble routes to it).
    BundleError when the repository has no ensemble."""
    graph = ensembles(repository, unreadable)
    if not graph:
        raise BundleError(f"{repository}: has no ensemble model")
    return sorted(set(graph) | {m for steps in graph.values() for m in steps})


def set_ensemble_encoder(repository: Path, encoder: str) -> list[Path]:
    """Route every ensemble of the repository to ``<name>_<encoder>`` (``python``, ``onnx`` or
    ``trt``): rewrites the second step of ``<name>/config.pbtxt`` (the documented edit). Returns
    the files changed; a BundleError when the target model is not in the repository or does not
    offer the tensors the ensemble maps."""
    from google.protobuf import text_format

    if encoder not in TRITON_ENCODERS:
        raise BundleError(f"encoder must be one of {', '.join(TRITON_ENCODERS)}, got {encoder!r}")
    changed = []
    for name in ensembles(repository, []):
        path = repository / name / TRITON_CONFIG
        config = _parse_config(path)
        step = config.ensemble_scheduling.step[-1]
        target = f"{name}_{encoder}"
        if step.model_name == target:
            continue
        target_config = repository / target / TRITON_CONFIG
        if not target_config.is_file():
            hint = " (the bundle has no model.plan yet)" if encoder == "trt" else ""
            raise BundleError(f"{repository}: has no model {target}{hint}; ensemble {name} keeps "
                              f"{step.model_name}")
        model = _parse_config(target_config)
        offered = {t.name for t in model.input} | {t.name for t in model.output}
        missing = sorted((set(step.input_map) | set(step.output_map)) - offered)
        if missing:
            raise BundleError(f"{target_config}: lacks tensors {missing} that ensemble {name} maps")
        step.model_name = target
        comments = [line for line in path.read_text(encoding="utf-8").splitlines() if line.startswith("#")]
        path.write_text("\n".join(comments + [text_format.MessageToString(config)]), encoding="utf-8")
        changed.append(path)
    return changed


def curl_example(http_url: str, model: str, output: str = "sentence_embedding") -> str:
    body = ('{"inputs":[{"name":"TEXT","shape":[1,1],"datatype":"BYTES","data":["Hello Triton"]}],'
            f'"outputs":[{{"name":"{output}"}}]}}')
    return f"curl -s -X POST http://{http_url}/v2/models/{model}/infer -d '{body}'"


def first_output(repo: Path, name: str) -> str:
    outputs = [t.name for t in _parse_config(repo / name / TRITON_CONFIG).output]
    return outputs[0] if outputs else "sentence_embedding"
