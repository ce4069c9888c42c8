"""Remote reward against real local HTTP servers (http.server in a thread, 127.0.0.1, free port)."""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest
from transport_helpers import free_port

from grpo.config import RewardConfig
from grpo.rewards import RemoteRewardError, RewardError, build_reward_functions, get_reward_function, score

# (status, JSON-able body or raw text, seconds to wait before answering)
Reply = tuple[int, object, float]


class Server:
    """A local endpoint whose answer to the i-th POST (0-based) is ``reply(i, request_json)``."""

    def __init__(self, reply: Callable[[int, dict], Reply]) -> None:
        self.requests: list[dict] = []  # {"json": ..., "headers": ...} per POST received
        self.release = threading.Event()  # set at teardown so slow handlers finish at once
        server = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
                index = len(server.requests)
                server.requests.append({"json": body, "headers": dict(self.headers)})
                status, payload, delay = reply(index, body)
                if delay:
                    server.release.wait(delay)
                data = payload.encode() if isinstance(payload, str) else json.dumps(payload).encode()
                self.send_response(status)
                self.send_header("Content-Type", "application/json")
                self.send_header("Content-Length", str(len(data)))
                self.end_headers()
                self.wfile.write(data)

            def log_message(self, *args) -> None:  # keep test output clean
                pass

        self.httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.httpd.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.httpd.server_address[1]}/score"
        self.thread = threading.Thread(target=self.httpd.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.release.set()
        self.httpd.shutdown()
        self.httpd.server_close()
        self.thread.join(timeout=5)


@pytest.fixture
def serve() -> Iterator[Callable[[Callable[[int, dict], Reply]], Server]]:
    servers: list[Server] = []

    def start(reply: Callable[[int, dict], Reply]) -> Server:
        servers.append(Server(reply))
        return servers[-1]

    yield start
    for server in servers:
        server.close()


def length_rewards(index: int, body: dict) -> Reply:
    """Reward = completion length; null for an empty completion."""
    return 200, {"rewards": [float(len(c)) if c else None for c in body["completions"]]}, 0.0


def test_posts_the_batch_and_reads_rewards(serve):
    server = serve(length_rewards)
    fn = get_reward_function("remote", url=server.url, token="s3cret", timeout_s=5)
    prompts = [[{"role": "user", "content": "q1"}], [{"role": "user", "content": "q2"}]]
    completions = [[{"role": "assistant", "content": "abc"}], ""]
    rewards = fn(prompts, ["abc", ""], answer=["1", "2"], trainer_state=object())
    assert rewards == [3.0, None]
    body = server.requests[0]["json"]
    # the wire format: version, the batch, and only the per-sample columns (trainer_state is dropped)
    assert body == {"version": 1, "prompts": prompts, "completions": ["abc", ""], "columns": {"answer": ["1", "2"]}}
    assert server.requests[0]["headers"]["Authorization"] == "Bearer s3cret"
    assert fn.__name__ == f"remote_127.0.0.1_{server.httpd.server_address[1]}"
    # conversational completions travel as message lists
    fn(prompts, completions)
    assert server.requests[1]["json"]["completions"] == completions


def test_token_from_environment(serve, monkeypatch):
    server = serve(length_rewards)
    monkeypatch.setenv("GRPO_TEST_REWARD_TOKEN", "from-env")
    fn = get_reward_function("remote", url=server.url, token_env="GRPO_TEST_REWARD_TOKEN")
    fn(["p"], ["c"])
    assert server.requests[0]["headers"]["Authorization"] == "Bearer from-env"
    monkeypatch.delenv("GRPO_TEST_REWARD_TOKEN")
    with pytest.raises(ValueError, match="'GRPO_TEST_REWARD_TOKEN'.*not set"):
        get_reward_function("remote", url=server.url, token_env="GRPO_TEST_REWARD_TOKEN")


def test_retries_a_5xx_then_succeeds(serve):
    server = serve(lambda i, body: (503, {"error": "warming up"}, 0.0) if i == 0 else length_rewards(i, body))
    fn = get_reward_function("remote", url=server.url, retries=2, backoff_s=0.01)
    assert fn(["p", "p"], ["ab", "abcd"]) == [2.0, 4.0]
    assert len(server.requests) == 2  # one failure, one success


def test_always_500_is_a_clear_error(serve):
    server = serve(lambda i, body: (500, "Traceback: KeyError 'answer'", 0.0))
    fn = get_reward_function("remote", url=server.url, retries=2, backoff_s=0.01, name="judge")
    with pytest.raises(RemoteRewardError) as error:
        fn(["p"], ["c"])
    message = str(error.value)
    assert "remote reward 'judge'" in message and server.url in message
    assert "after 3 attempts" in message and "HTTP 500" in message
    assert "Traceback: KeyError 'answer'" in message  # body excerpt
    assert len(server.requests) == 3  # 1 try + 2 retries


def test_4xx_is_not_retried(serve):
    server = serve(lambda i, body: (401, {"detail": "bad token"}, 0.0))
    fn = get_reward_function("remote", url=server.url, retries=3, backoff_s=0.01)
    with pytest.raises(RemoteRewardError, match=r"HTTP 401.*bad token"):
        fn(["p"], ["c"])
    assert len(server.requests) == 1


def test_timeout_is_a_clear_error_and_not_retried(serve):
    server = serve(lambda i, body: (200, {"rewards": [1.0]}, 2.0))  # answers after 2 s
    fn = get_reward_function("remote", url=server.url, timeout_s=0.2, retries=3, backoff_s=0.01)
    with pytest.raises(RemoteRewardError, match=r"at http://127\.0\.0\.1:\d+/score: no answer within timeout_s=0.2 s"):
        fn(["p"], ["c"])
    assert len(server.requests) == 1  # a slow server is not hammered with retries


@pytest.mark.parametrize(
    ("reply", "match"),
    [
        ({"rewards": [1.0]}, "got 1 rewards for 2 completions"),
        ({"scores": [1.0, 2.0]}, r'expected a JSON object \{"rewards"'),
        ({"rewards": [1.0, "high"]}, "reward at index 1 is 'high'"),
        ("not json", "bad answer"),
    ],
)
def test_malformed_answers_are_errors(serve, reply, match):
    server = serve(lambda i, body: (200, reply, 0.0))
    fn = get_reward_function("remote", url=server.url, retries=2, backoff_s=0.01)
    with pytest.raises(RemoteRewardError, match=match):
        fn(["p", "p"], ["a", "b"])
    assert len(server.requests) == 1


def test_connection_refused_is_retried_then_reported():
    url = f"http://127.0.0.1:{free_port()}/score"  # nothing listens there
    fn = get_reward_function("remote", url=url, retries=1, backoff_s=0.01, timeout_s=1)
    with pytest.raises(RemoteRewardError, match=r"connection failed after 2 attempts"):
        fn(["p"], ["c"])


def test_an_endpoint_down_from_the_start_is_an_error_naming_it(caplog):
    # A remote reward that never answered is a configuration error (wrong URL, server not started);
    # one that has worked and then fails abstains for that batch (test_rewards_scoring).
    url = f"http://127.0.0.1:{free_port()}/score"
    specs = [RewardConfig("remote", params={"url": url, "retries": 0, "timeout_s": 1}), RewardConfig("xmlcount")]
    fns = build_reward_functions(specs, tag_style="reasoning")
    with pytest.raises(RewardError, match=r"(?s)'remote_127.0.0.1_\d+' failed on every one of the 2 samples.*"
                                          r"RemoteRewardError.*connection failed"):
        score(fns, [1.0, 1.0], ["p", "p"], ["a", "b"], {})


def test_bad_settings_are_rejected():
    with pytest.raises(ValueError, match="must start with http"):
        get_reward_function("remote", url="127.0.0.1:8000")
    with pytest.raises(ValueError, match="timeout_s > 0"):
        get_reward_function("remote", url="http://x", timeout_s=0)
    with pytest.raises(ValueError, match="token or token_env, not both"):
        get_reward_function("remote", url="http://x", token="a", token_env="B")
