"""The OpenAI API of `deployments/afd.yaml`, over real HTTP, on a real Ray cluster.

The application is the shipped YAML's (SmolLM2-135M-Instruct on CPU, 1A:1F), deployed
once for the session by the `client` fixture of tests/conftest.py.
"""

from __future__ import annotations

import json
import os
import time

import httpx
import psutil
import pytest
import ray
from ray import serve
from ray.util import placement_group_table

from afd_ray.platform import DATA_PLANE_NICE

MODEL = "smollm2"
QUESTION = [{"role": "user", "content": "What is the capital of France?"}]


def _chat(**fields: object) -> dict[str, object]:
    return {"model": MODEL, "messages": QUESTION, "temperature": 0, "max_tokens": 24} | fields


def _completion(**fields: object) -> dict[str, object]:
    body = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8}
    return body | {"temperature": 0} | fields


def _sse_payloads(response: httpx.Response) -> list[str]:
    """The `data:` payloads of an SSE response, in order."""
    return [line.removeprefix("data: ") for line in response.iter_lines() if line]


def test_models_lists_the_served_model(client: httpx.Client) -> None:
    response = client.get("/v1/models")
    assert response.status_code == 200
    models = response.json()["data"]
    assert [m["id"] for m in models] == [MODEL]
    assert models[0]["max_model_len"] == 2048


def test_chat_answers_paris(client: httpx.Client) -> None:
    response = client.post("/v1/chat/completions", json=_chat())
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "chat.completion"
    assert body["model"] == MODEL
    (choice,) = body["choices"]
    assert choice["message"]["role"] == "assistant"
    assert "Paris" in choice["message"]["content"]
    assert 0 < body["usage"]["completion_tokens"] <= 24


def test_completion_continues_the_prompt(client: httpx.Client) -> None:
    response = client.post("/v1/completions", json=_completion())
    assert response.status_code == 200, response.text
    body = response.json()
    assert body["object"] == "text_completion"
    (choice,) = body["choices"]
    assert "Paris" in choice["text"]
    assert body["usage"]["completion_tokens"] == 8
    assert choice["finish_reason"] == "length"


@pytest.mark.parametrize(
    ("path", "request_body", "full_text", "delta_text"),
    [
        (
            "/v1/chat/completions",
            _chat(),
            lambda body: body["choices"][0]["message"]["content"],
            lambda chunk: chunk["choices"][0]["delta"].get("content") or "",
        ),
        (
            "/v1/completions",
            _completion(max_tokens=16),
            lambda body: body["choices"][0]["text"],
            lambda chunk: chunk["choices"][0]["text"],
        ),
    ],
    ids=["chat", "completions"],
)
def test_streaming_joins_into_the_non_streaming_text(
    client: httpx.Client, path, request_body, full_text, delta_text
) -> None:
    expected = full_text(client.post(path, json=request_body).json())

    with client.stream("POST", path, json=request_body | {"stream": True}) as response:
        assert response.status_code == 200
        assert response.headers["content-type"].startswith("text/event-stream")
        payloads = _sse_payloads(response)

    assert payloads[-1] == "[DONE]"
    chunks = [json.loads(p) for p in payloads[:-1]]
    assert len(chunks) > 2, "expected one event per token, not one blob"
    assert "".join(delta_text(c) for c in chunks) == expected


OUT_OF_VOCABULARY = 49152
"""The first token id past SmolLM2's vocabulary (49152 ids)."""


def _too_long_prompt() -> str:
    return "hello " * 2100  # > 2048 tokens, the context of the YAML's model


@pytest.mark.parametrize(
    ("path", "content", "status", "param"),
    [
        ("/v1/chat/completions", b'{"model": "smollm2", "messages": [', 400, "body"),
        ("/v1/chat/completions", b'{"model": "smollm2\xff\xfe"}', 400, "body"),
        ("/v1/chat/completions", json.dumps(_chat(model="gpt-17")), 404, "model"),
        ("/v1/chat/completions", json.dumps(_chat(model="gpt-17", stream=True)), 404, "model"),
        ("/v1/chat/completions", json.dumps(_chat(max_tokens=-1)), 400, "max_tokens"),
        ("/v1/completions", json.dumps(_completion(max_tokens=-5)), 400, "max_tokens"),
        ("/v1/chat/completions", json.dumps(_chat(messages="hi")), 400, "messages"),
        (
            "/v1/chat/completions",
            json.dumps(_chat(messages=[{"role": "user", "content": _too_long_prompt()}])),
            400,
            "input_tokens",
        ),
        (
            "/v1/completions",
            json.dumps(_completion(prompt=_too_long_prompt(), stream=True)),
            400,
            "input_tokens",
        ),
        ("/v1/chat/completions", json.dumps(_chat(n=-1)), 400, "n"),
        ("/v1/completions", json.dumps(_completion(n=0)), 400, "n"),
        ("/v1/completions", json.dumps(_completion(n=1000, temperature=1.0)), 400, "n"),  # admitted as 1
        ("/v1/chat/completions", json.dumps(_chat(n=17, temperature=1.0, stream=True)), 400, "n"),  # > 16 seqs
        ("/v1/chat/completions", json.dumps(_chat(messages=[])), 400, "messages"),
        ("/v1/chat/completions", json.dumps(_chat(top_k=-5)), 400, "top_k"),  # vLLM's check named no param
        ("/v1/completions", json.dumps(_completion(frequency_penalty=5)), 400, "frequency_penalty"),
        ("/v1/completions", json.dumps(_completion(n=2)), 400, "n"),  # greedy (temperature 0) needs n = 1
        ("/v1/completions", json.dumps(_completion(prompt=[1, OUT_OF_VOCABULARY])), 400, "prompt"),
        ("/v1/completions", json.dumps(_completion(prompt=[[1], [OUT_OF_VOCABULARY]], stream=True)), 400, "prompt"),
        ("/v1/completions", json.dumps(_completion(stop=["a", "b", "c", "d", "e"])), 400, "stop"),
        ("/v1/chat/completions", json.dumps(_chat(stop=["a", 5])), 400, "stop.1"),
    ],
    ids=[
        "malformed-json",
        "invalid-utf8-body",
        "unknown-model",
        "unknown-model-stream",
        "negative-max-tokens-chat",
        "negative-max-tokens-completion",
        "messages-not-a-list",
        "prompt-over-context-chat",
        "prompt-over-context-completion-stream",
        "n-negative-chat",
        "n-zero-completion",
        "n-over-max-num-seqs-completion",
        "n-over-max-num-seqs-chat-stream",
        "messages-empty",
        "top-k-negative-chat",
        "frequency-penalty-over-2-completion",
        "n-over-1-greedy-completion",
        "prompt-token-out-of-vocabulary",
        "prompt-token-out-of-vocabulary-batch-stream",
        "stop-over-the-limit",
        "stop-list-item-not-a-string",
    ],
)
def test_bad_input_is_an_openai_error_and_serving_goes_on(
    client: httpx.Client, path: str, content: bytes | str, status: int, param: str
) -> None:
    response = client.post(path, content=content, headers={"content-type": "application/json"})

    assert response.status_code == status, response.text
    assert response.headers["content-type"] == "application/json"
    error = response.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert error["param"] == param
    assert error["code"] == status
    assert error["message"]

    good = client.post("/v1/chat/completions", json=_chat(max_tokens=4))
    assert good.status_code == 200, good.text


def test_a_bad_field_of_several_types_names_its_bound(client: httpx.Client) -> None:
    """`stop` is a string or a list of at most 4 strings: a list of 5 names that
    limit, not "Input should be a valid string" (the error of the other type)."""
    response = client.post("/v1/chat/completions", json=_chat(stop=["a", "b", "c", "d", "e"]))
    assert response.status_code == 400, response.text
    message = response.json()["error"]["message"]
    assert message.startswith("stop: List should have at most 4 items"), message


def test_client_disconnect_aborts_the_request_in_vllm(client: httpx.Client) -> None:
    attention = serve.get_deployment_handle("attention", app_name="afd")
    long_answer = _chat(max_tokens=1500, ignore_eos=True, stream=True)

    with client.stream("POST", "/v1/chat/completions", json=long_answer) as response:
        events = response.iter_lines()
        for _ in range(4):
            next(events)
        assert attention.num_unfinished_requests.remote().result() == 1

    deadline = time.monotonic() + 10
    while attention.num_unfinished_requests.remote().result() and time.monotonic() < deadline:
        time.sleep(0.2)
    assert attention.num_unfinished_requests.remote().result() == 0


def test_health(client: httpx.Client) -> None:
    assert client.get("/health").status_code == 200


def _ffn_layers(client: httpx.Client) -> int:
    """FFN rank 0's layer counter once it has been the same for 1 s (counters are
    pushed to the coordinator every 0.2 s)."""
    seen = [client.get("/afd/status").json()["ffn"][0]["layers"]]
    while len(seen) < 5 or len(set(seen[-5:])) > 1:
        time.sleep(0.25)
        seen.append(client.get("/afd/status").json()["ffn"][0]["layers"])
    return seen[-1]


def test_afd_status_shows_the_mlps_ran_on_the_ffn_rank(client: httpx.Client) -> None:
    status = client.get("/afd/status").json()
    assert status["epoch"] == 0
    assert [(m["rank"], m["ffn_peer"], m["state"]) for m in status["attention"]] == [(0, 0, "ready")]
    assert [(m["rank"], m["state"], m["ep_rank"]) for m in status["ffn"]] == [(0, "ready", 0)]

    before = _ffn_layers(client)
    response = client.post("/v1/chat/completions", json=_chat())
    assert "Paris" in response.json()["choices"][0]["message"]["content"]
    after = _ffn_layers(client)
    layers = 30  # SmolLM2-135M has 30 decoder layers, every MLP on the FFN rank
    completion_tokens = response.json()["usage"]["completion_tokens"]
    assert after > before
    assert (after - before) % layers == 0
    assert (after - before) // layers >= completion_tokens  # >= one step per token


@pytest.mark.parametrize("pool", ["attention", "ffn"])
def test_each_pool_member_has_its_own_strict_pack_group(
    client: httpx.Client, args: dict[str, object], pool: str
) -> None:
    section = args[pool]
    status = serve.status().applications["afd"].deployments[pool]
    assert status.replica_states == {"RUNNING": section["num_ranks"]}

    # Serve names a replica's placement group after the replica actor.
    members = [
        group
        for group in placement_group_table().values()
        if group["name"].startswith(f"SERVE_REPLICA::afd#{pool}#") and group["state"] == "CREATED"
    ]
    assert len(members) == section["num_ranks"]
    bundle = {"CPU": section["bundle_resources"]}
    assert all(group["strategy"] == "STRICT_PACK" for group in members)
    assert [group["bundles"] for group in members] == [{0: bundle}] * section["num_ranks"]


def _replica_pids(app: str, deployment: str) -> list[int]:
    """The process ids of the running replicas of `deployment` in Serve application
    `app` (Serve names a replica's actor `SERVE_REPLICA::<app>#<deployment>#<id>`)."""
    prefix = f"SERVE_REPLICA::{app}#{deployment}#"
    actors = [
        ray.get_actor(actor["name"], namespace=actor["namespace"])
        for actor in ray.util.list_named_actors(all_namespaces=True)
        if actor["name"].startswith(prefix)
    ]
    return ray.get([actor.__ray_call__.remote(lambda _: os.getpid()) for actor in actors], timeout=30)


def _engine_of(replica: int) -> psutil.Process:
    """The one vLLM EngineCore child process of the attention replica with pid `replica`:
    the replica's multiprocessing child (its other child is multiprocessing's resource
    tracker). vLLM titles it `VLLM::EngineCore` with setproctitle, but once (full suite,
    2026-12-03) /proc showed the spawn command line while that engine ran and logged,
    so the title is not what finds it."""
    children = psutil.Process(replica).children()
    engines = [
        child
        for child in children
        if " ".join(child.cmdline()).startswith("VLLM::EngineCore") or "spawn_main" in " ".join(child.cmdline())
    ]
    assert len(engines) == 1, [(child.pid, child.cmdline()) for child in children]
    return engines[0]


def test_engine_processes_inherit_the_engine_env(client: httpx.Client, args: dict[str, object]) -> None:
    """vLLM's EngineCore process of each attention replica of the session app runs
    with the env of `engine_env` and no assignment variable (its FFN peer comes in vLLM's config,
    `FFNPeerConfig`), and the model runs in it:
    no worker process of its own (vLLM's CPU platform forces its `mp` executor unless
    `VLLM_ENABLE_V1_MULTIPROCESSING=0`; that worker re-imported vLLM at every rank
    start).

    The engines are the replicas' own child processes, found through Ray. The env is
    the one the engine was started with (`/proc/<pid>/environ`), readable there
    because `engine_env` sets `SPT_NOENV` (tests/attention/test_engine_env.py)."""
    replicas = _replica_pids("afd", "attention")
    assert len(replicas) == args["attention"]["num_ranks"]
    for replica in replicas:
        process = _engine_of(replica)
        env = process.environ()
        assert "AFD_RAY_ASSIGNMENT" not in env  # the FFN peer comes in vLLM's config, not the env
        assert env["OMP_NUM_THREADS"] == "1"
        assert env["OMP_WAIT_POLICY"] == "PASSIVE"
        assert env["VLLM_CPU_OMP_THREADS_BIND"] == "nobind"
        assert env["VLLM_ENABLE_V1_MULTIPROCESSING"] == "0"
        below = [" ".join(child.cmdline()) for child in process.children(recursive=True)]
        assert not [c for c in below if c.startswith("VLLM::")], (process.cmdline(), below)


def _thread_nices(pid: int) -> set[int]:
    """The niceness of each thread of process `pid` (field 19 of /proc/<pid>/task/<tid>/stat)."""
    nices = set()
    for tid in os.listdir(f"/proc/{pid}/task"):
        with open(f"/proc/{pid}/task/{tid}/stat") as stat:
            nices.add(int(stat.read().rpartition(")")[2].split()[16]))
    return nices


def test_model_compute_runs_below_the_control_planes_priority(client: httpx.Client) -> None:
    """`lower_data_plane_priority`: each attention replica's EngineCore, and the FFN
    replica's compute loop thread, run `DATA_PLANE_NICE` below the replica process's
    own priority, which the ingress replica keeps on every thread; so on full cores
    the ingress, HAProxy and the coordinator run before the next model step
    (docs/failures.md)."""
    for replica in _replica_pids("afd", "attention"):
        base, engine = psutil.Process(replica).nice(), _engine_of(replica)
        assert engine.nice() == min(19, base + DATA_PLANE_NICE), (base, engine.nice())
    for replica in _replica_pids("afd", "ffn"):
        base = psutil.Process(replica).nice()
        assert min(19, base + DATA_PLANE_NICE) in _thread_nices(replica), (base, _thread_nices(replica))
    for replica in _replica_pids("afd", "ingress"):
        assert min(19, psutil.Process(replica).nice() + DATA_PLANE_NICE) not in _thread_nices(replica)
