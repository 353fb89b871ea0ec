"""``task.reward=http://...`` (slime's ``--rm-url``): each completion is scored by a real HTTP reward server run
here (``http.server`` on a thread). What it receives, what its answers become, retries of a failing server, the
time limit and every bad answer, and a short RL run scored by it."""

from __future__ import annotations

import json
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from megatron_logra.rewards import Problem, RewardTimeout, TaskConfig, build_task
from megatron_logra.rewards.remote import API_KEY_ENV, RemoteScorer

pytestmark = pytest.mark.filterwarnings("ignore::DeprecationWarning", "ignore::UserWarning")


class Server:
    """A reward server: ``answer(request) -> (status, body text)``; every request body (JSON) and header is kept."""

    def __init__(self, answer):
        self.answer, self.seen, self.headers = answer, [], []
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self):
                data = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                server.seen.append(data)
                server.headers.append(dict(self.headers))
                status, text = server.answer(data)
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.end_headers()
                self.wfile.write(text.encode())

            def log_message(self, *args):
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        self.thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)
        self.thread.start()

    def close(self):
        self.httpd.shutdown()
        self.httpd.server_close()


@pytest.fixture
def serve():
    servers = []

    def start(answer):
        servers.append(Server(answer))
        return servers[-1]

    yield start
    for s in servers:
        s.close()


def _contains_label(data):
    return 200, json.dumps({"reward": 1.0 if data["label"] in data["response"] else 0.0})


PROBLEM = Problem(prompt="What is 2 + 3?", answer="5", source="jsonl:/data/x.jsonl", metadata={"id": "7", "line": 3})


def test_the_server_gets_the_sample_and_its_answer_is_the_score(serve, monkeypatch):
    server = serve(_contains_label)
    monkeypatch.setenv(API_KEY_ENV, "secret")
    scorer = RemoteScorer(server.url, timeout_s=10)
    assert scorer.score(PROBLEM, "it is 5") == 1.0 and scorer.score(PROBLEM, "it is 6") == 0.0
    assert server.seen[0] == {"prompt": "What is 2 + 3?", "response": "it is 5", "label": "5",
                              "source": "jsonl:/data/x.jsonl", "id": "7", "metadata": {"id": "7", "line": 3}}
    assert server.headers[0]["Authorization"] == "Bearer secret"


@pytest.mark.parametrize("text,score", [("0.25", 0.25), ('{"score": 1}', 1.0), ('{"reward": 0}', 0.0)])
def test_a_number_or_an_object_holding_one(serve, text, score):
    server = serve(lambda data: (200, text))
    assert RemoteScorer(server.url).score(PROBLEM, "x") == score


@pytest.mark.parametrize("status,text,match", [
    (200, "1.5", r"answered '1\.5'; expected a number in \[0, 1\]"),
    (200, '{"reward": NaN}', r"expected a number in \[0, 1\]"),
    (200, '{"value": 1}', r"answered '\{\"value\": 1\}'"),
    (200, "yes", r"answered 'yes', not JSON"),
    (403, '{"error": "bad key"}', r"answered HTTP 403 \(Forbidden\): '\{\"error\": \"bad key\"\}'"),
])
def test_a_bad_answer_names_the_server_and_what_it_said(serve, status, text, match):
    server = serve(lambda data: (status, text))
    with pytest.raises(ValueError, match=match) as err:
        RemoteScorer(server.url).score(PROBLEM, "x")
    assert server.url in str(err.value)
    assert len(server.seen) == 1  # a 4xx or a bad answer is not retried


def test_a_failing_server_is_retried_then_named(serve, monkeypatch):
    monkeypatch.setattr("megatron_logra.rewards.remote.time.sleep", lambda s: None)  # no pauses in a test
    answers = iter([(503, "busy"), (500, "oops"), (200, "1")])
    server = serve(lambda data: next(answers))
    assert RemoteScorer(server.url).score(PROBLEM, "x") == 1.0 and len(server.seen) == 3
    down = serve(lambda data: (502, "gateway"))
    with pytest.raises(ValueError, match=r"failed 4 times \(last: HTTP 502 \(Bad Gateway\): 'gateway'\)"):
        RemoteScorer(down.url).score(PROBLEM, "x")


def test_an_unreachable_server_is_named(serve, monkeypatch):
    monkeypatch.setattr("megatron_logra.rewards.remote.time.sleep", lambda s: None)
    server = serve(_contains_label)
    url = server.url
    server.close()
    with pytest.raises(ValueError, match=r"failed 4 times \(last: ConnectionRefusedError.*is it running and reachable"):
        RemoteScorer(url).score(PROBLEM, "x")


def test_a_server_slower_than_the_limit_is_a_reward_timeout(serve):
    server = serve(lambda data: (time.sleep(2.0), (200, "1"))[1])
    start = time.monotonic()
    with pytest.raises(RewardTimeout, match=r"did not answer within 0\.5 s \(task\.reward_timeout_s=0\.5"):
        RemoteScorer(server.url, timeout_s=0.5).score(PROBLEM, "x")
    assert time.monotonic() - start < 1.5


def test_the_url_is_a_task_reward_and_slimes_rm_url(serve, tmp_path):
    from megatron_logra.config import parse_args_to_config

    server = serve(_contains_label)
    cfg = parse_args_to_config("tiny", ["--rm-url", server.url])
    assert cfg.task.reward == server.url
    task = build_task(cfg.task)
    problem = task.train_problem(0)
    assert task.score(problem, f"so {problem.answer}") == (1.0, True)
    with pytest.raises(ValueError, match=r"task\.reward='ftp://x': use auto, math_verify, a dotted path"):
        TaskConfig(reward="ftp://x")


def test_an_rl_run_is_scored_by_the_server(serve, tmp_path):
    from support.run_fixtures import run_rl_recipe

    server = serve(_contains_label)
    run = tmp_path / "run"
    run_rl_recipe("tiny", [f"train.run_dir={run}", "rl.steps=1", "rl.prompts_per_step=2", "rl.group_size=2",
                           "rl.micro_batch_size=4", "task.num_eval=2", "rl.log_samples=4", "train.progress=false",
                           f"task.reward={server.url}"])
    samples = [json.loads(line) for line in (run / "samples.jsonl").read_text().splitlines()]
    # 2 held-out answers before and after, 4 rollouts: each scored by the server, by its rule
    assert len(server.seen) == 2 + 4 + 2 and len(samples) == 8
    for r in samples:
        assert r["correct"] == (r["answer"] in r["completion"])
    assert [d["response"] for d in server.seen] == [r["completion"] for r in samples]
