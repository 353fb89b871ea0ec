"""CPU stand-ins for SGLang's side of policy sync, written after its source (python/sglang/srt/...).

``SGLangLlama`` has SGLang's Llama parameter names and TP shard shapes (fused ``qkv_proj`` /
``gate_up_proj``, row-parallel ``o_proj`` / ``down_proj``, vocab-padded embeddings with
``org_vocab_size``); ``SGLangQwen2`` is the same without ``get_weights_by_name`` (like
``Qwen2ForCausalLM`` and ``Qwen3ForCausalLM``). ``SchedulerRuntime`` does what ``ModelRunner.
update_weights_from_tensor`` does with a request (custom loader by dotted path when listed in
``custom_weight_loader``, ``model.load_weights`` for ``load_format=None``, anything else kills the
scheduler) and what ``get_weights_by_name`` returns (fp32 ``tolist()``, truncated); ``FakeEngine``
passes tensors through ``ForkingPickler`` like ``Engine.update_weights_from_tensor``.
``DataParallelRuntime`` is SGLang's ``--dp-size N`` as the tokenizer manager sees it: with
``--enable-dp-attention`` one TP group whose attention is split over ``tp / N`` ranks (``SGLangQwen2(...,
dp_attention=N)``), ``get_weights_by_name`` answered like ``TokenizerManager.get_weights_by_name`` (the
bare answer at dp_size 1, the list of every data-parallel rank's otherwise); ``FakeEngine`` and
``FakeServer`` (SGLang's HTTP routes) refuse tensor updates at dp_size > 1 without
``enable_dp_attention``, as the tokenizer manager asserts.
``FakeServer`` records every request and unpickles with an allow-list like SGLang's ``SafeUnpickler``;
``send_json`` is its JSON answer, for other test HTTP handlers too; the ``servers`` fixture closes them.
``FakeSGLang`` answers ``/generate`` payloads the way SGLang documents them; ``FakeTarget`` is the
``sglang_client`` target protocol with canned answers. ``delta_chain`` makes a chain of random sketch
deltas on ``SHAPE`` and ``reference`` applies them to an HF-layout state with the trainer's apply.
"""

from __future__ import annotations

import base64
import importlib
import io
import json
import pickle
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from multiprocessing.reduction import ForkingPickler
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from megatron_logra.sync import SyncError
from megatron_logra.sync.sglang_loader import LOADER_PATH
from megatron_logra.sync.apply import apply_delta_
from megatron_logra.sync.synthetic import DenseShape, random_delta

__all__ = ["D", "F", "G", "H", "HID", "PADDED", "SHAPE", "V", "VOCAB", "DataParallelRuntime", "Embedding", "FakeEngine",
           "FakeSGLang", "FakeServer", "FakeTarget", "Linear", "Norm", "SGLangLlama", "SGLangQwen2", "SafeUnpickler",
           "SchedulerRuntime", "delta_chain", "hf_state", "reference", "send_json", "servers"]

ADMIN_OPTIONAL_ROUTES = frozenset({"/update_weights_from_tensor", "/update_weight_version", "/get_weights_by_name"})
"""Routes SGLang's ``http_server.py`` marks ``@auth_level(AuthLevel.ADMIN_OPTIONAL)`` (among those the client uses)."""
ADMIN_OPTIONAL_CONTROL_ROUTES = frozenset({"/pause_generation", "/continue_generation", "/flush_cache"})
"""Control routes newer SGLang also marks ``ADMIN_OPTIONAL`` (with both keys set they take only the admin key);
``FakeServer(admin_routes=ADMIN_OPTIONAL_ROUTES | ADMIN_OPTIONAL_CONTROL_ROUTES)`` serves them that way."""

DP_UPDATE_ASSERT = "dp_size must be 1 or dp attention must be enabled for update weights from tensor"
"""``TokenizerManager.update_weights_from_tensor``'s assertion message."""

H, G, D, F, V, HID = 4, 2, 8, 48, 40, 32
SHAPE = DenseShape(hidden=HID, layers=2, heads=H, kv_heads=G, ffn=F, vocab=V)
VOCAB, PADDED = 40, 48  # FakeSGLang's real and padded vocabulary


def hf_state(seed=0) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    return {k: (torch.randn(*s, generator=gen) * 0.02).to(torch.bfloat16) for k, s in SHAPE.hf_shapes().items()}


class Linear(nn.Module):
    def __init__(self, weight, tp_size, tp_rank):
        super().__init__()
        self.tp_size, self.tp_rank = tp_size, tp_rank
        self.weight = nn.Parameter(weight.clone(), requires_grad=False)


class Embedding(nn.Module):
    """VocabParallelEmbedding / ParallelLMHead: padded rows, ``org_vocab_size`` real ones."""

    def __init__(self, weight, org_vocab_size):
        super().__init__()
        self.org_vocab_size = org_vocab_size
        self.weight = nn.Parameter(weight.clone(), requires_grad=False)


class Norm(nn.Module):
    def __init__(self, weight):
        super().__init__()
        self.weight = nn.Parameter(weight.clone(), requires_grad=False)


class SGLangQwen2(nn.Module):
    """The parameters SGLang's Llama and Qwen2 classes lay out on rank ``rank`` of ``tp``, and no
    ``get_weights_by_name`` (like ``Qwen2ForCausalLM`` and ``Qwen3ForCausalLM``).

    ``dp_attention``: SGLang's ``--dp-size`` with ``--enable-dp-attention`` (1: off). Attention is then
    split over ``attn_tp = tp / dp_attention`` ranks (``QKVParallelLinear(..., tp_rank=attn_tp_rank,
    tp_size=attn_tp_size)``, ``attn_tp_rank = rank % attn_tp``), ``embed_tokens`` is unsharded
    (``VocabParallelEmbedding(enable_tp=not is_dp_attention_enabled())``), and the MLP and ``lm_head``
    stay split over all ``tp`` ranks. The weights are loaded from ``hf`` by :meth:`load_weights`."""

    def __init__(self, hf, tp=1, rank=0, vocab_pad=0, dp_attention=1):
        super().__init__()
        if tp % dp_attention:
            raise ValueError(f"dp_attention={dp_attention} must divide tp={tp} (SGLang's check)")
        self.config = SimpleNamespace(num_attention_heads=H, num_key_value_heads=G, head_dim=D, hidden_size=HID,
                                      vocab_size=V)
        attn_tp = tp // dp_attention
        self._layout = SimpleNamespace(tp=tp, rank=rank, attn_tp=attn_tp, attn_rank=rank % attn_tp,
                                       embed_tp=1 if dp_attention > 1 else tp)
        lay = self._layout
        hq, kv, f, cols = H // attn_tp, G // attn_tp, F // tp, H * D // attn_tp
        dtype = hf["model.norm.weight"].dtype

        def zeros(*shape):
            return torch.zeros(*shape, dtype=dtype)

        self.model = nn.Module()
        self.model.embed_tokens = Embedding(zeros(V // lay.embed_tp + vocab_pad, HID), V // lay.embed_tp)
        self.model.layers = nn.ModuleList()
        for _ in range(SHAPE.layers):
            layer, attn, mlp = nn.Module(), nn.Module(), nn.Module()
            attn.qkv_proj = Linear(zeros((hq + 2 * kv) * D, HID), attn_tp, lay.attn_rank)
            attn.o_proj = Linear(zeros(HID, cols), attn_tp, lay.attn_rank)
            mlp.gate_up_proj = Linear(zeros(2 * f, HID), tp, rank)
            mlp.down_proj = Linear(zeros(HID, f), tp, rank)
            layer.self_attn, layer.mlp = attn, mlp
            layer.input_layernorm = Norm(zeros(HID))
            layer.post_attention_layernorm = Norm(zeros(HID))
            self.model.layers.append(layer)
        self.model.norm = Norm(zeros(HID))
        self.lm_head = Embedding(zeros(V // tp + vocab_pad, HID), V // tp)
        self.load_weights(hf.items())

    @torch.no_grad()
    def load_weights(self, named):
        """SGLang's default loader: each HF tensor's share of this rank goes into its parameter (q/k/v and
        gate/up stacked into the fused ones, ``o_proj``/``down_proj`` columns, vocabulary rows);
        ``embed_tokens`` / ``lm_head`` through ``VocabParallelEmbedding.weight_loader``, which asserts
        exactly ``org_vocab_size`` (= ``config.vocab_size``) rows in all and zeroes its padding rows."""
        params = dict(self.named_parameters())
        lay = self._layout
        for name, t in named:
            if name in ("model.embed_tokens.weight", "lm_head.weight"):
                assert t.shape[0] == self.config.vocab_size, \
                    f"self.org_vocab_size={self.config.vocab_size} loaded_weight.shape[output_dim]={t.shape[0]}"
                size, r = (lay.embed_tp, lay.rank % lay.embed_tp) if name.startswith("model.") else (lay.tp, lay.rank)
                rows = t.shape[0] // size
                params[name].data[:rows].copy_(t[r * rows: (r + 1) * rows])
                params[name].data[rows:].fill_(0)
                continue
            head, _, leaf = name.rpartition(".")
            module = head.rpartition(".")[2]
            pre = head[: len(head) - len(module)]
            if module in ("q_proj", "k_proj", "v_proj"):
                hq, kv, r = H // lay.attn_tp * D, G // lay.attn_tp * D, lay.attn_rank
                n, offset = {"q_proj": (hq, 0), "k_proj": (kv, hq), "v_proj": (kv, hq + kv)}[module]
                params[f"{pre}qkv_proj.{leaf}"].data[offset: offset + n].copy_(t[r * n: (r + 1) * n])
            elif module in ("gate_proj", "up_proj"):
                f = F // lay.tp
                offset = 0 if module == "gate_proj" else f
                params[f"{pre}gate_up_proj.{leaf}"].data[offset: offset + f].copy_(t[lay.rank * f: (lay.rank + 1) * f])
            elif module in ("o_proj", "down_proj"):
                size, r = (lay.attn_tp, lay.attn_rank) if module == "o_proj" else (lay.tp, lay.rank)
                cols = t.shape[1] // size
                params[name].data.copy_(t[:, r * cols: (r + 1) * cols])
            else:
                params[name].data.copy_(t)


class SGLangLlama(SGLangQwen2):
    """``LlamaForCausalLM``: the same layout, plus its ``get_weights_by_name`` (root parameters by name)."""

    def get_weights_by_name(self, name, truncate_size=100, tp_size=1):
        param = dict(self.named_parameters())[name]
        return param.detach().cpu().to(torch.float32).numpy().tolist()[:truncate_size]


class SchedulerRuntime:
    """The scheduler side: ``ModelRunner.update_weights_from_tensor`` and ``get_weights_by_name`` of each TP rank."""

    def __init__(self, models, loaders=(LOADER_PATH,)):
        self.models = models
        self.custom_weight_loader = list(loaders)
        self.dead = None

    def update(self, rank, named_tensors, load_format):
        if self.dead:
            raise RuntimeError(f"scheduler is dead: {self.dead}")
        model = self.models[rank]
        named_tensors = [(n, t.to("cpu")) for n, t in named_tensors]  # _unwrap_tensor(..., device)
        try:
            if load_format in self.custom_weight_loader:
                module, _, fn = load_format.rpartition(".")  # sglang.srt.utils.dynamic_import
                getattr(importlib.import_module(module), fn)(model, named_tensors)
            elif load_format is None:
                model.load_weights(named_tensors)
            else:
                raise NotImplementedError(f"Unknown load_format={load_format}")
        except Exception as exc:  # no try in SGLang: the scheduler process dies, the server with it
            self.dead = repr(exc)
            raise

    def get_weights_by_name(self, name, truncate_size=100):
        try:  # ModelRunner.get_weights_by_name: delegate to the model class, None on any error
            return self.models[0].get_weights_by_name(name, truncate_size, tp_size=len(self.models))
        except Exception:
            return None


class DataParallelRuntime(SchedulerRuntime):
    """SGLang's ``--tp T --dp N`` (``N = dp_size``) as its tokenizer manager sees it.

    With ``enable_dp_attention`` (the only data parallelism SGLang updates weights under) the engine is one
    scheduler group of ``T`` TP ranks, ``models`` (built with ``SGLangQwen2(..., dp_attention=N)``): ``update``
    reaches TP rank ``rank`` as in :class:`SchedulerRuntime`, and ``get_weights_by_name`` asks each of the
    ``N`` data-parallel ranks (its first TP rank, ``d·T/N``, answers) and returns the list of their answers,
    ``None`` for one that could not read (``TokenizerManager.get_weights_by_name``; the bare answer at
    ``N == 1``). Without it the ``N`` ranks are independent copies of the model and SGLang refuses every
    tensor update (``FakeEngine`` and ``FakeServer`` assert first): ``models`` stand for one copy, whose
    answer every rank gives.
    """

    def __init__(self, models, dp_size, *, enable_dp_attention=True, loaders=(LOADER_PATH,)):
        super().__init__(models, loaders)
        if enable_dp_attention and len(models) % dp_size:
            raise ValueError(f"dp_size={dp_size} must divide the {len(models)} TP ranks with dp attention")
        self.dp_size = dp_size
        self.enable_dp_attention = enable_dp_attention
        step = len(models) // dp_size if enable_dp_attention else 0
        self.dp_heads = [d * step for d in range(dp_size)]
        """The TP rank that answers for each data-parallel rank."""

    def get_weights_by_name(self, name, truncate_size=100):
        answers = []
        for head in self.dp_heads:
            try:  # ModelRunner.get_weights_by_name of that rank: None on any error
                answers.append(self.models[head].get_weights_by_name(name, truncate_size, tp_size=len(self.models)))
            except Exception:
                answers.append(None)
        return answers[0] if self.dp_size == 1 else answers


class FakeEngine:
    """``sglang.Engine``'s weight-update surface; tensors go through ForkingPickler (``_serialize_tensors_per_rank``).

    ``runtime``: a ``SchedulerRuntime`` or a ``DataParallelRuntime`` (``server_args.dp_size`` is its size)."""

    def __init__(self, runtime, tp_size=1):
        self.runtime = runtime
        self.server_args = SimpleNamespace(custom_weight_loader=runtime.custom_weight_loader, tp_size=tp_size,
                                           dp_size=getattr(runtime, "dp_size", 1),
                                           enable_dp_attention=getattr(runtime, "enable_dp_attention", False))
        self.calls = []

    def update_weights_from_tensor(self, named_tensors, load_format=None, flush_cache=True):
        self.calls.append(("update", load_format, flush_cache, [n for n, _ in named_tensors]))
        assert self.server_args.dp_size == 1 or self.server_args.enable_dp_attention, DP_UPDATE_ASSERT
        for rank in range(self.server_args.tp_size):
            buf = io.BytesIO()
            ForkingPickler(buf).dump(named_tensors)
            self.runtime.update(rank, ForkingPickler.loads(buf.getvalue()), load_format)
        return True, "Success"

    def get_weights_by_name(self, name, truncate_size=100):
        self.calls.append(("get", name))
        return self.runtime.get_weights_by_name(name, truncate_size)


class SafeUnpickler(pickle.Unpickler):
    """SGLang's ``SafeUnpickler`` allow-list (module prefixes), enough for tensors pickled by value."""

    ALLOWED = ("builtins.", "collections.", "copyreg.", "torch.")

    def find_class(self, module, name):
        if any((module + ".").startswith(p) for p in self.ALLOWED):
            return super().find_class(module, name)
        raise pickle.UnpicklingError(f"Blocked unsafe class loading ({module}.{name})")


def send_json(handler: BaseHTTPRequestHandler, status: int, body) -> None:
    """Answer ``handler``'s request with ``status`` and ``body`` as JSON (``Content-Type`` and ``Content-Length`` set)."""
    data = json.dumps(body).encode()
    handler.send_response(status)
    handler.send_header("Content-Type", "application/json")
    handler.send_header("Content-Length", str(len(data)))
    handler.end_headers()
    handler.wfile.write(data)


class FakeServer:
    """SGLang's HTTP routes used by the client, over a ``SchedulerRuntime`` or ``DataParallelRuntime``, on a local
    port, recording every request.

    ``requests`` holds each request's ``method``, ``path``, JSON ``body`` and ``headers`` (names lowercased);
    ``paths()`` its paths. Keys as SGLang's ``--api-key`` / ``--admin-api-key`` (``decide_request_auth``): the
    routes in ``admin_routes`` (default :data:`ADMIN_OPTIONAL_ROUTES`) take ``admin_api_key`` when it is set, else
    ``api_key``; every other
    route takes ``api_key``; a route with no key to check is open; a wrong or missing key gets 401.
    ``info_paths`` (default: ``/server_info`` and ``/get_server_info``, as newer servers; older ones have only
    ``/get_server_info``) answer ``server_info`` (default: the server arguments ``tp_size``, ``dp_size``,
    ``enable_dp_attention``, ``custom_weight_loader``, and ``weight_version``).
    ``/update_weights_from_tensor`` fails with 500 when the tokenizer manager's dp assertion fails, with 400
    and ``fail_update`` as its message when that is set (SGLang's own refusal, e.g. a payload it cannot
    deserialise), with 400 when the number of entries is not ``tp_size``; else it unpickles
    ``serialized_named_tensors[tp_rank]`` with SGLang's allow-list for each TP rank (500 when the scheduler
    raises). ``/get_weights_by_name`` answers 400 when the tokenizer manager returns None (dp_size 1), else 200
    with its answer (at dp_size > 1 a list, ``null`` for a replica that could not read).
    ``/update_weight_version`` keeps ``new_version`` in ``weight_version``; ``/pause_generation`` and
    ``/continue_generation`` answer as SGLang does; any other route is 404.
    """

    def __init__(self, runtime, *, tp_size=1, api_key=None, admin_api_key=None, server_info=None, fail_update=None,
                 info_paths=("/server_info", "/get_server_info"), admin_routes=ADMIN_OPTIONAL_ROUTES):
        self.runtime, self.tp_size, self.api_key, self.admin_api_key = runtime, tp_size, api_key, admin_api_key
        self.admin_routes = frozenset(admin_routes)
        self.info_paths = info_paths
        self.server_info = server_info if server_info is not None else {
            "tp_size": tp_size, "dp_size": getattr(runtime, "dp_size", 1),
            "enable_dp_attention": getattr(runtime, "enable_dp_attention", False),
            "custom_weight_loader": runtime.custom_weight_loader, "weight_version": "default"}
        self.fail_update = fail_update
        self.requests = []
        self.weight_version = "default"
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args):
                pass

            def _handle(self):
                n = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(n) if n else b""
                body = json.loads(raw) if raw else None
                owner.requests.append({"method": self.command, "path": self.path, "body": body,
                                       "headers": {k.lower(): v for k, v in self.headers.items()}})
                if not owner.authorized(self.path, self.headers.get("Authorization")):
                    return send_json(self, 401, {"error": "Unauthorized"})
                send_json(self, *owner.route(self.command, self.path, body))

            do_GET = do_POST = _handle

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def authorized(self, path, header):
        if path.startswith("/health") or path.startswith("/metrics"):
            return True
        key = (self.admin_api_key or self.api_key) if path in self.admin_routes else self.api_key
        return not key or header == "Bearer " + key

    def route(self, method, path, body):
        info = self.server_info
        if path in self.info_paths and method == "GET":
            return 200, info
        if path == "/update_weights_from_tensor" and method == "POST":
            if not (info.get("dp_size", 1) == 1 or info.get("enable_dp_attention")):
                return 500, {"detail": f"Internal Server Error: AssertionError('{DP_UPDATE_ASSERT}')"}
            if self.fail_update:
                return 400, {"success": False, "message": self.fail_update}
            entries = body["serialized_named_tensors"]
            if len(entries) != self.tp_size:
                return 400, {"success": False, "message": f"{len(entries)} entries for tp_size {self.tp_size}"}
            try:
                for rank in range(self.tp_size):  # each scheduler reads serialized_named_tensors[tp_rank]
                    named = SafeUnpickler(io.BytesIO(base64.b64decode(entries[rank], validate=True))).load()
                    self.runtime.update(rank, named, body["load_format"])
            except Exception as exc:
                return 500, {"detail": f"Internal Server Error: {exc!r}"}
            return 200, {"success": True, "message": "Success"}
        if path == "/get_weights_by_name":
            ret = self.runtime.get_weights_by_name(body["name"], body.get("truncate_size", 100))
            if ret is None:
                return 400, {"error": {"message": "Get parameter by name failed"}}
            return 200, ret
        if path == "/pause_generation":
            return 200, {"message": "Generation paused successfully.", "status": "ok"}
        if path == "/continue_generation":
            return 200, {"message": "Generation continued successfully.", "status": "ok"}
        if path == "/update_weight_version":
            self.weight_version = body["new_version"]
            return 200, {"success": True, "message": f"Weight version updated to {body['new_version']}",
                         "new_version": body["new_version"]}
        return 404, {"detail": "Not Found"}

    def paths(self):
        return [r["path"] for r in self.requests]

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def servers():
    """A list the test appends the ``FakeServer``s it starts to; each is closed after the test (import it as a fixture)."""
    made = []
    yield made
    for s in made:
        s.close()


def delta_chain(n, *, start=0, dense=True, rank=8):
    """``n`` chained random sketch deltas on ``SHAPE`` (versions ``start`` -> ``start + n``), rank ``rank``;
    with ``dense`` every even-versioned one also sets ``model.norm.weight`` densely."""
    out = []
    for v in range(start, start + n):
        extra = {"model.norm.weight": torch.full((HID,), 1.0 + v / 8)} if dense and v % 2 == 0 else {}
        out.append(random_delta(SHAPE, rank, base_version=v, new_version=v + 1, update_index=v, seed=11,
                                generator_seed=v, scale=2e-3, dense=extra))
    return out


def reference(hf, applied):
    """A copy of the HF-layout state ``hf`` with the deltas ``applied`` applied in order by the trainer's
    ``apply_delta_``: what an engine holding ``hf`` must hold bitwise after receiving them."""
    ref = {k: v.clone() for k, v in hf.items()}
    for d in applied:
        apply_delta_(ref, d, d.base_version)
    return ref


class FakeSGLang:
    """Answers ``/generate`` payloads like SGLang: bigram logits ``table[last token]`` (+ logit_bias),
    greedy for T = 0 (log-probs of softmax(z)), else sampled from softmax(z/T) with its log-prob.

    ``vocab_size`` is the served model's (``PADDED``: like the in-process engine; ``VOCAB``: a server
    started from the unpadded checkpoint); its logits are the first ``vocab_size`` columns of
    ``table``, and a ``logit_bias`` key outside ``[0, vocab_size)`` fails the request as SGLang's
    ``SamplingParams.verify`` does."""

    def __init__(self, seed: int = 0, as_tuples: bool = True, vocab_size: int = PADDED) -> None:
        g = torch.Generator().manual_seed(seed)
        self.table = torch.randn(PADDED, PADDED, generator=g, dtype=torch.float64) * 2
        self.vocab_size = vocab_size
        self.gen = torch.Generator().manual_seed(seed + 1)
        self.as_tuples = as_tuples
        self.payloads: list[dict] = []
        self.weight_version = None

    def __call__(self, payload: dict) -> list[dict]:
        self.payloads.append(payload)
        sp_all = payload["sampling_params"]
        outs = []
        for i, prompt in enumerate(payload["input_ids"]):
            sp = sp_all[i] if isinstance(sp_all, list) else sp_all
            bias = torch.zeros(self.vocab_size, dtype=torch.float64)
            for k, v in sp.get("logit_bias", {}).items():
                if not 0 <= int(k) < self.vocab_size:  # SamplingParams.verify(model_config.vocab_size)
                    raise ValueError(f"logit_bias must has keys in [0, {self.vocab_size - 1}], got {k}.")
                bias[int(k)] += v
            last, ids, entries, reason = prompt[-1], [], [], None
            for _ in range(sp["max_new_tokens"]):
                z = self.table[last, : self.vocab_size] + bias
                if sp["temperature"] == 0:
                    tok = int(torch.argmax(z))
                    logp = torch.log_softmax(z, -1)[tok]
                else:
                    lp = torch.log_softmax(z / sp["temperature"], -1)
                    tok = int(torch.multinomial(lp.exp(), 1, generator=self.gen))
                    logp = lp[tok]
                ids.append(tok)
                entry = (float(logp), tok, None)
                entries.append(entry if self.as_tuples else list(entry))
                last = tok
                if tok in sp["stop_token_ids"]:
                    reason = {"type": "stop", "matched": tok}
                    break
            reason = reason or {"type": "length", "length": len(ids)}
            meta = {"output_token_logprobs": entries, "finish_reason": reason, "completion_tokens": len(ids),
                    "prompt_tokens": len(prompt)}
            if self.weight_version is not None:
                meta["weight_version"] = self.weight_version
            outs.append({"output_ids": ids, "meta_info": meta})
        return outs


class FakeTarget:
    """The ``sglang_client`` target protocol with a version and canned answers."""

    def __init__(self, version: int = 0, vocab_size=None) -> None:
        self.weight_version = version
        self.vocab_size = vocab_size  # the served model's, as the sync loader reports it (None: not said)
        self.calls: list[str] = []

    def apply_sketch_delta(self, delta):
        self.calls.append("delta")
        if delta == "bad":
            raise SyncError("gap", "delta 5->6 does not follow version 0")
        if delta == "boom":
            raise OSError("connection reset")
        self.weight_version += 1
        return self.weight_version

    def update_weights_full(self, hf_state, version):
        self.calls.append("full")
        for i, _ in enumerate(hf_state.items() if isinstance(hf_state, dict) else hf_state):
            if version == 13 and i == 1:
                raise OSError("refit upload failed")
        self.weight_version = version

    def fingerprint(self):
        return {"w": f"hash-{self.weight_version}"}
