"""Start-up rules of the SGLang engine (``megatron_logra.rollout.sglang_setup``), on CPU.

* ``rl.rollout.sglang_tp`` against the DP replica's GPUs: the replicas' rank groups come from megatron-core's
  own ``RankGenerator`` (the layout ``initialize_parallel`` builds), the device counts are passed in.
* The API key: never in ``RUN/config.yaml`` or a checkpoint's config (a real RL run on the embedded engine
  writes them), and a run resumed from those files sends the key from ``SGLANG_API_KEY`` to a real HTTP
  server, never the placeholder the files hold.
"""

from __future__ import annotations

import json
import threading
import warnings
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from types import SimpleNamespace

import pytest
import yaml
from megatron.core.parallel_state import RankGenerator

from megatron_logra.rl.config import RolloutConfig
from megatron_logra.rollout.sglang_setup import (
    API_KEY_ENV,
    REDACTED_API_KEY,
    check_engine_gpus,
    contiguous_run,
    redact_config,
    resolve_api_key,
)
from support.sglang_stand_ins import send_json

SECRET = "sk-SECRET-8c1f"


# --------------------------------------------------------------------------- rl.rollout.sglang_tp


def replica_layout(tp: int, pp: int, dp: int) -> list[tuple[int, int]]:
    """Per DP replica of a one-node job: (the GPU its engine starts on, the replica's GPUs from there up),
    from megatron-core's rank groups (model-parallel group = tp x pp ranks; rank r uses GPU r)."""
    groups = RankGenerator(tp=tp, ep=1, dp=dp, pp=pp, cp=1, order="tp-cp-ep-dp-pp").get_ranks("tp-pp")
    assert len(groups) == dp
    return [(min(ranks), contiguous_run(ranks, min(ranks))) for ranks in groups]


def fits(sglang_tp: int, tp: int, pp: int, dp: int, device_count: int) -> list[bool]:
    out = []
    for base, run in replica_layout(tp, pp, dp):
        try:
            check_engine_gpus(sglang_tp, base_gpu_id=base, device_count=device_count, replica_gpus=run)
            out.append(True)
        except ValueError as exc:
            assert "rl.rollout.sglang_tp" in str(exc) and "set rl.rollout.sglang_tp to at most" in str(exc)
            out.append(False)
    return out


def test_replica_gpus_follow_megatrons_rank_order():
    assert replica_layout(2, 1, 4) == [(0, 2), (2, 2), (4, 2), (6, 2)]
    assert replica_layout(2, 4, 1) == [(0, 8)]  # one replica: all 8 GPUs are its own
    assert replica_layout(2, 2, 2) == [(0, 2), (2, 2)]  # ranks {0,1,4,5} and {2,3,6,7}: 2 contiguous each
    assert contiguous_run([4, 5, 6], 3) == 0


def test_sglang_tp_larger_than_the_replica_or_the_node_is_refused():
    # the report's example: tp=2, dp=4 on 8 GPUs, sglang_tp=4 -> replicas 0..2 overlap the next, 3 runs off the node
    assert fits(4, tp=2, pp=1, dp=4, device_count=8) == [False] * 4
    assert fits(2, tp=2, pp=1, dp=4, device_count=8) == [True] * 4
    assert fits(1, tp=2, pp=1, dp=4, device_count=8) == [True] * 4
    assert fits(8, tp=2, pp=4, dp=1, device_count=8) == [True]
    assert fits(4, tp=2, pp=2, dp=2, device_count=8) == [False, False]
    with pytest.raises(ValueError, match=r"rl\.rollout\.sglang_tp=4: .*GPUs 6\.\.9, but this node has 8 visible"):
        check_engine_gpus(4, base_gpu_id=6, device_count=8, replica_gpus=2)
    with pytest.raises(ValueError, match=r"rl\.rollout\.sglang_tp=4: .*use 2 GPU\(s\) from GPU 0 up.*GPUs 2\.\.3 "
                                         r"of another replica.*at most 2"):
        check_engine_gpus(4, base_gpu_id=0, device_count=8, replica_gpus=2)
    with pytest.raises(ValueError, match=r"rl\.rollout\.sglang_tp=0"):
        check_engine_gpus(0, base_gpu_id=0, device_count=8, replica_gpus=2)


# --------------------------------------------------------------------------- the API key


def test_redaction_and_the_environment_variable():
    data = {"rl": {"rollout": {"sglang_api_key": SECRET, "engine": "sglang"}}, "train": {"seed": 1}}
    safe = redact_config(data)
    assert safe["rl"]["rollout"]["sglang_api_key"] == REDACTED_API_KEY and SECRET not in json.dumps(safe)
    assert data["rl"]["rollout"]["sglang_api_key"] == SECRET  # the run's own config keeps its key
    assert redact_config({"rl": {"rollout": {"sglang_api_key": ""}}})["rl"]["rollout"]["sglang_api_key"] == ""
    assert redact_config({"job": "lm"}) == {"job": "lm"}
    assert RolloutConfig(sglang_api_key=REDACTED_API_KEY).sglang_api_key == ""  # a saved placeholder: no key
    assert resolve_api_key(SECRET, {API_KEY_ENV: "from-env"}) == SECRET
    assert resolve_api_key("", {API_KEY_ENV: "from-env"}) == "from-env"
    assert resolve_api_key("", {}) is None
    assert resolve_api_key(REDACTED_API_KEY, {API_KEY_ENV: REDACTED_API_KEY}) is None
    with pytest.raises(ValueError, match=r"rl\.rollout\.sglang_api_key"):
        RolloutConfig(sglang_api_key=123)


def test_a_key_from_a_secret_file_loses_its_newline_and_a_key_that_cannot_be_sent_is_refused_unquoted():
    """A key read from a mounted secret ends in a newline: it is stripped, from either source. A key that
    still holds a line break, a control character or whitespace inside (or a character no HTTP header can
    carry) is refused naming where it came from -- never quoting it, so no rank's log holds it."""
    assert resolve_api_key("", {API_KEY_ENV: SECRET + "\n"}) == SECRET
    assert resolve_api_key(f"  {SECRET}\r\n", {}) == SECRET
    assert resolve_api_key(" \n", {API_KEY_ENV: f"\t{SECRET} "}) == SECRET  # all whitespace: unset
    assert resolve_api_key("", {API_KEY_ENV: f" {REDACTED_API_KEY}\n"}) is None
    for config_key, env, source in [(f"{SECRET}\r\nX-Injected: 1", {}, r"rl\.rollout\.sglang_api_key"),
                                    ("", {API_KEY_ENV: f"{SECRET}\x00"}, API_KEY_ENV),
                                    ("", {API_KEY_ENV: "sk SECRET"}, API_KEY_ENV),
                                    (f"{SECRET}\u2028x", {}, r"rl\.rollout\.sglang_api_key"),
                                    (f"{SECRET}\u20ac", {}, r"rl\.rollout\.sglang_api_key")]:
        with pytest.raises(ValueError, match=source) as err:
            resolve_api_key(config_key, env)
        assert "SECRET" not in str(err.value) and "8c1f" not in str(err.value)


class _KeyRecorder:
    """An HTTP server that records every request's ``Authorization`` header and answers 401 (SGLang's
    answer to a wrong key) unless it is ``Bearer <key>``, then 404."""

    def __init__(self, key: str) -> None:
        self.seen: list = []
        owner = self

        class Handler(BaseHTTPRequestHandler):
            def _handle(self):
                n = int(self.headers.get("Content-Length") or 0)
                if n:
                    self.rfile.read(n)
                auth = self.headers.get("Authorization")
                owner.seen.append(auth)
                status = 404 if auth == f"Bearer {key}" else 401
                send_json(self, status, {"error": "Unauthorized" if status == 401 else "Not Found"})

            do_GET = do_POST = _handle

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}"
        threading.Thread(target=self.httpd.serve_forever, daemon=True).start()

    def close(self) -> None:
        self.httpd.shutdown()
        self.httpd.server_close()


def test_a_run_never_writes_the_key_and_its_resume_sends_the_environments(tmp_path, monkeypatch, one_thread):
    """A real (tiny, CPU, embedded-engine) RL run with ``rl.rollout.sglang_api_key`` set writes no file that
    holds the key; ``train --resume RUN`` reads its config.yaml back (the CLI's own reader), and the SGLang
    engine built from it sends ``SGLANG_API_KEY``'s key -- or none -- but never the placeholder."""
    from megatron_logra.cli.run_dir import run_dir_config
    from megatron_logra.config import parse_args_to_config
    from megatron_logra.parallel import destroy_parallel
    from megatron_logra.rl.job import run_rl
    from megatron_logra.rollout.sglang_engine import SGLangEngine
    from megatron_logra.sync.sglang_client import SGLangError

    run = tmp_path / "run"
    cfg = parse_args_to_config("tiny", [
        "model.num_layers=1", "model.hidden_size=32", "model.ffn_hidden_size=64", "model.num_attention_heads=4",
        "model.num_query_groups=2", "sft.steps=0", "sft.init_path=", "tokenizer.path=", "sft.cache=false",
        "rl.steps=2", "rl.prompts_per_step=2", "rl.group_size=2", "rl.micro_batch_size=4",
        "task.num_eval=2", "rl.eval_interval=0", "train.save_interval=1", f"train.run_dir={run}",
        "train.progress=false", f"rl.rollout.sglang_api_key={SECRET}"])
    assert cfg.rl.rollout.sglang_api_key == SECRET
    destroy_parallel()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            run_rl(cfg)
        finally:
            destroy_parallel()
    assert cfg.rl.rollout.sglang_api_key == SECRET  # the running job kept its key in memory
    written = [p for p in run.rglob("*") if p.is_file()]
    assert len(list((run / "checkpoints").glob("step_*"))) == 2  # the interval save and the final one
    assert not [p for p in written if SECRET.encode() in p.read_bytes()]
    saved = yaml.safe_load((run / "config.yaml").read_text())
    assert saved["rl"]["rollout"]["sglang_api_key"] == REDACTED_API_KEY
    for meta in run.glob("checkpoints/step_*/meta.json"):
        assert json.loads(meta.read_text())["config"]["rl"]["rollout"]["sglang_api_key"] == REDACTED_API_KEY

    server = _KeyRecorder("from-env")
    try:
        resumed = run_dir_config(run, [
            "rl.rollout.engine=sglang", f"rl.rollout.sglang_url={server.url}", "rl.rollout.sglang_serialization=pickle"])
        assert resumed.train.resume and resumed.rl.rollout.sglang_api_key == ""
        groups = SimpleNamespace(mp=None, tp_size=1, dp_rank=0)
        monkeypatch.setenv(API_KEY_ENV, "from-env")
        with pytest.raises(SGLangError) as err:  # past the key: the recorder has no SGLang routes
            SGLangEngine.from_config(resumed, groups)
        assert err.value.kind != "auth"
        monkeypatch.delenv(API_KEY_ENV)
        with pytest.raises(SGLangError, match="401 unauthorized"):
            SGLangEngine.from_config(resumed, groups)
    finally:
        server.close()
    assert server.seen and server.seen[0] == "Bearer from-env"
    assert f"Bearer {REDACTED_API_KEY}" not in server.seen and None in server.seen


def test_the_engine_sends_a_secret_files_key_without_its_newline_and_refuses_a_broken_one_before_sending(monkeypatch):
    """``SGLangEngine.from_config`` resolves the key on every rank before anything is sent: the trailing
    newline of a secret file is not sent, and a key that cannot travel in a header stops the start with an
    error naming ``SGLANG_API_KEY`` (not http.client's, which quotes the header)."""
    from megatron_logra.config import load_recipe
    from megatron_logra.rollout.sglang_engine import SGLangEngine
    from megatron_logra.sync.sglang_client import SGLangError

    server = _KeyRecorder("from-env")
    try:
        cfg = load_recipe("tiny")
        cfg.rl.rollout = RolloutConfig(engine="sglang", sglang_url=server.url, sglang_serialization="pickle")
        groups = SimpleNamespace(mp=None, tp_size=1, dp_rank=0)
        monkeypatch.setenv(API_KEY_ENV, "from-env\n")
        with pytest.raises(SGLangError) as err:  # past the key: the recorder has no SGLang routes
            SGLangEngine.from_config(cfg, groups)
        # both server-info paths (the recorder answers 404 to each), each with the key stripped of its newline
        assert err.value.kind != "auth" and server.seen == ["Bearer from-env"] * 2
        monkeypatch.setenv(API_KEY_ENV, "from-env\r\nX-Injected: 1")
        with pytest.raises(ValueError, match=API_KEY_ENV) as err:
            SGLangEngine.from_config(cfg, groups)
        assert "from-env" not in str(err.value) and not isinstance(err.value, SGLangError)
        assert server.seen == ["Bearer from-env"] * 2  # nothing more was sent
    finally:
        server.close()


def test_the_config_command_prints_the_key_redacted(capsys):
    """``megatron-logra config`` output is often saved as a recipe file: it holds the placeholder, which
    read back means "take the key from SGLANG_API_KEY"."""
    from megatron_logra.cli import main

    assert main(["config", "tiny", "rl.rollout.sglang_api_key=sk-printed-0815"]) == 0
    out = capsys.readouterr().out
    assert "sk-printed-0815" not in out
    assert yaml.safe_load(out)["rl"]["rollout"]["sglang_api_key"] == REDACTED_API_KEY

