"""``TritonEncoder``: ``Encoder.encode`` over a Triton server serving a bundle's repository.

    from mbert.runtime import TritonEncoder

    enc = TritonEncoder("localhost:8000")                   # the server's only ensemble
    vectors = enc.encode(["a query", "a document"])           # float32 [2, D], as Encoder.encode
    enc.last_stats.truncated                                  # texts cut to the max length

Texts go as they are: the ensemble applies no prompt (pass ``prompt=`` to prepend one, as
``Encoder.encode(prompt=...)`` does; bundles whose pooling excludes prompt tokens pool them in the
served graph). ``tritonclient`` is imported when the first client is made
(``pip install 'mbert-export[serve]'``). Safe to share between threads: each thread gets its own
connection.
"""
from __future__ import annotations

import threading
import time
from typing import Any, Sequence

import numpy as np

from mbert.runtime.serve.server import ServeError
from mbert.runtime.text import EncodeStats

OUTPUTS = {"sentence": "sentence_embedding", "tokens": "last_hidden_state"}


class TritonEncoder:
    """``url``: ``host:port`` of the HTTP (default) or gRPC endpoint (``http://`` is accepted);
    ``model``: the ensemble (default: the server's only ensemble); ``timeout``: seconds per call."""

    def __init__(self, url: str, model: str | None = None, protocol: str = "http", *,
                 timeout: float = 60.0):
        if protocol not in ("http", "grpc"):
            raise ValueError(f"protocol must be 'http' or 'grpc', got {protocol!r}")
        self.url = url.split("://", 1)[-1].rstrip("/")
        self.protocol, self.timeout = protocol, timeout
        self._local = threading.local()
        self.model = model or self._only_ensemble()
        config = self._config(self.model)
        if [i.get("name") for i in config.get("input", [])] != ["TEXT"]:
            raise ServeError(f"model {self.model!r} on {self.url} does not take TEXT; TritonEncoder "
                             "needs the bundle's ensemble")
        self.max_batch = int(config.get("max_batch_size") or 1)
        self.output_dims = {o["name"]: [int(d) for d in o.get("dims", [])] for o in config.get("output", [])}
        self.output_names = list(self.output_dims)

    # --- connection ------------------------------------------------------------------------------
    def client(self) -> Any:
        """This thread's tritonclient ``InferenceServerClient``."""
        c = getattr(self._local, "client", None)
        if c is None:
            if self.protocol == "http":
                import tritonclient.http as module

                c = module.InferenceServerClient(self.url, connection_timeout=self.timeout,
                                                 network_timeout=self.timeout)
            else:
                import tritonclient.grpc as module

                c = module.InferenceServerClient(self.url)
            self._local.client, self._local.module = c, module
        return c

    def _call(self, what: str, fn, *args, **kwargs):
        from tritonclient.utils import InferenceServerException

        try:
            return fn(*args, **kwargs)
        except InferenceServerException as exc:
            raise ServeError(f"Triton at {self.url} ({self.protocol}) refused {what}: "
                             f"{exc.message()}") from exc

    def _config(self, model: str) -> dict:
        kwargs = {"as_json": True} if self.protocol == "grpc" else {}
        got = self._call(f"the config of {model!r}", self.client().get_model_config, model, **kwargs)
        return got.get("config", got)

    def _only_ensemble(self) -> str:
        kwargs = {"as_json": True} if self.protocol == "grpc" else {}
        index = self._call("the repository index", self.client().get_model_repository_index, **kwargs)
        models = index.get("models", index) if isinstance(index, dict) else index
        names = [m["name"] for m in models if m.get("state") == "READY"]
        found = [n for n in names if self._config(n).get("platform") == "ensemble"]
        if len(found) != 1:
            raise ServeError(f"{self.url} serves {len(found)} ensembles ({', '.join(found) or 'none'}); "
                             "pass model=")
        return found[0]

    @property
    def last_stats(self) -> EncodeStats:
        """This thread's last call: texts, tokens, truncated (and which), requests, time."""
        return getattr(self._local, "stats", None) or EncodeStats()

    # --- encode ------------------------------------------------------------------------------------
    def encode(self, texts: str | Sequence[str], *, output: str = "sentence", prompt: str = "",
               batch_size: int | None = None):
        """Like ``Encoder.encode``: float32 [N, D] (a [D] vector for one string), or with
        ``output="tokens"`` a list of [len_i, hidden] arrays (needs an ensemble that returns
        ``last_hidden_state``). Sent in requests of ``batch_size`` texts (default and at most the
        model's ``max_batch_size``)."""
        if output not in OUTPUTS:
            raise ValueError(f"output must be 'sentence' or 'tokens', got {output!r}")
        name = OUTPUTS[output]
        if name not in self.output_names:
            raise ServeError(f"model {self.model!r} does not return {name} (it returns "
                             f"{', '.join(self.output_names)})")
        single = isinstance(texts, str)
        items = [texts] if single else list(texts)
        for i, t in enumerate(items):
            if not isinstance(t, str):
                raise TypeError(f"texts[{i}] is {type(t).__name__} ({t!r:.40}), expected a str")
        step = min(batch_size or self.max_batch, self.max_batch)
        stats, start = EncodeStats(texts=len(items)), time.perf_counter()
        parts, counts = [], []
        for lo in range(0, len(items), step):
            got = self._infer([prompt + t for t in items[lo: lo + step]], name)
            counts.append(got["num_tokens"].reshape(-1))
            stats.truncated_indices += [lo + int(i) for i in np.flatnonzero(got["truncated"].reshape(-1))]
            parts.append(got[name])
            stats.batches += 1
        n_tokens = np.concatenate(counts) if counts else np.zeros(0, dtype=np.int64)
        stats.tokens, stats.truncated = int(n_tokens.sum()), len(stats.truncated_indices)
        if output == "tokens":
            rows = [row for part in parts for row in part]
            result: Any = [row[: int(n)] for row, n in zip(rows, n_tokens)]
        else:
            result = np.concatenate(parts).astype(np.float32, copy=False) if parts else \
                np.zeros([0] + self.output_dims[name], dtype=np.float32)
        stats.total_s = time.perf_counter() - start
        self._local.stats = stats
        return result[0] if single else result

    def _infer(self, texts: list[str], output: str) -> dict[str, np.ndarray]:
        client = self.client()
        module = self._local.module
        data = np.array([[t.encode("utf-8")] for t in texts], dtype=np.object_)
        tensor = module.InferInput("TEXT", list(data.shape), "BYTES")
        tensor.set_data_from_numpy(data)
        wanted = [module.InferRequestedOutput(n) for n in (output, "num_tokens", "truncated")]
        kwargs = {"client_timeout": self.timeout} if self.protocol == "grpc" else {}
        result = self._call(f"a request of {len(texts)} texts", client.infer, self.model, [tensor],
                            outputs=wanted, **kwargs)
        return {n: result.as_numpy(n) for n in (output, "num_tokens", "truncated")}
