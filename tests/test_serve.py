"""`longkv serve` as a client meets it: a real server process on 127.0.0.1 over a tiny random
Llama (a chat template on the GPT-2 tokenizer), driven by the official `openai` client: chat,
streaming, usage, a second question answered from the kept read as a fresh read answers it,
clients at once answered as one at a time, and each error in OpenAI's shape."""

from __future__ import annotations

import json
import os
import re
import signal
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import LlamaForCausalLM

from conftest import over_tokenizer, tiny_hf_config
from longkv.bench.serve import free_port
from longkv.document import read
from longkv.models.pretrained import load_pretrained
from longkv.serve.prompt import chat_parts, text_parts

openai = pytest.importorskip("openai")

TEMPLATE = (
    "{% for m in messages %}<|{{ m['role'] }}|>\n{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)
DOCUMENT = " ".join(f"Item {i % 37} lies in room {i % 11}." for i in range(120))
QUESTIONS = [f"Where does item {i} lie?" for i in range(8)]
MAX_TOKENS = 6


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory: pytest.TempPathFactory) -> str:
    """A folder with a random 1-layer Llama and the GPT-2 tokenizer given a chat template."""
    from longkv.train.tokenizer import gpt2_tokenizer

    folder = tmp_path_factory.mktemp("tiny_chat")
    tokenizer = gpt2_tokenizer()
    tokenizer.chat_template = TEMPLATE
    config = tiny_hf_config(**over_tokenizer(tokenizer), max_position_embeddings=4096)
    torch.manual_seed(0)
    LlamaForCausalLM(config).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return str(folder)


class Server:
    """A `longkv serve` process on a free port of 127.0.0.1."""

    def __init__(self, model: str, *options: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        argv = [sys.executable, "-m", "longkv", "serve", "--model", model, "--name", "tiny",
                "--port", str(self.port), *options]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1"}
        self.process = subprocess.Popen(argv, stderr=subprocess.PIPE, text=True, env=env)
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            assert self.process.poll() is None, self.process.stderr.read()
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=1) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        raise AssertionError("the server did not start")

    def wait_for(self, **state: object) -> None:
        """Wait until the server's /health says state (its worker running, jobs waiting)."""
        deadline = time.monotonic() + 120
        while True:
            with urllib.request.urlopen(self.url + "/health", timeout=10) as r:
                health = json.loads(r.read())
            if all(health[k] == v for k, v in state.items()):
                return
            assert time.monotonic() < deadline, health
            time.sleep(0.05)

    def client(self, key: str = "none") -> Any:
        return openai.OpenAI(base_url=self.url + "/v1", api_key=key, max_retries=0)

    def stop(self, sig: int = signal.SIGTERM) -> tuple[int, str]:
        self.process.send_signal(sig)
        _, err = self.process.communicate(timeout=60)
        return self.process.returncode, err


@pytest.fixture(scope="module")
def server(tiny_chat_model: str) -> Iterator[Server]:
    s = Server(tiny_chat_model, "--max-tokens", "64")
    yield s
    s.stop()


def ask(client: Any, question: str, document: str = DOCUMENT, **options: Any) -> Any:
    message = {"role": "user", "content": f"{document}\n\n{question}"}
    return client.chat.completions.create(
        model="tiny", messages=[message], **{"max_tokens": MAX_TOKENS, **options}
    )


@pytest.fixture(scope="module")
def fresh_answers(tiny_chat_model: str) -> dict[str, str]:
    """Each question's answer from a fresh read of the document in this process (`longkv.read`
    and `Document.ask`, as `longkv ask` answers)."""
    model, tokenizer = load_pretrained(tiny_chat_model)
    out = {}
    for q in QUESTIONS:
        doc = read(model, tokenizer, DOCUMENT, "fold", progress=False)
        out[q] = doc.ask(q, MAX_TOKENS).text
    return out


def test_a_second_question_is_answered_from_the_kept_read_as_a_fresh_read(
    server: Server, fresh_answers: dict[str, str]
) -> None:
    client = server.client()
    first = ask(client, QUESTIONS[0], document=DOCUMENT + " Once more.")
    second = ask(client, QUESTIONS[1], document=DOCUMENT + " Once more.")
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    kept = second.usage.prompt_tokens_details.cached_tokens
    assert 0 < kept < second.usage.prompt_tokens  # the document's tokens, not the question's
    for q in QUESTIONS[:2]:
        answer = ask(client, q)
        assert answer.choices[0].message.content == fresh_answers[q]
        assert answer.choices[0].message.role == "assistant"
        assert answer.usage.completion_tokens <= MAX_TOKENS
        total = answer.usage.prompt_tokens + answer.usage.completion_tokens
        assert answer.usage.total_tokens == total


def test_a_streamed_answer_joins_into_the_whole_answer_with_usage_last(
    server: Server, fresh_answers: dict[str, str]
) -> None:
    chunks = list(ask(server.client(), QUESTIONS[2], stream=True,
                      stream_options={"include_usage": True}))  # fmt: skip
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == fresh_answers[QUESTIONS[2]]
    assert chunks[-2].choices[0].finish_reason in ("stop", "length")
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens >= 1


def test_max_tokens_past_the_servers_limit_gets_the_limit(server: Server) -> None:
    prompt = f"{DOCUMENT}\n\nQuestion: {QUESTIONS[5]}\nAnswer:"  # a raw continuation: no stop
    got = server.client().completions.create(model="tiny", prompt=prompt, max_tokens=100000)
    assert got.usage.completion_tokens == 64 and got.choices[0].finish_reason == "length"


def test_a_text_prompt_splits_at_its_last_blank_line_as_ask_no_chat_reads(
    server: Server, tiny_chat_model: str
) -> None:
    model, tokenizer = load_pretrained(tiny_chat_model)
    doc = read(model, tokenizer, DOCUMENT, "fold", progress=False, chat=False)
    want = doc.ask(QUESTIONS[3], MAX_TOKENS, stop_at_repeat=False)  # a raw continuation
    prompt = f"{DOCUMENT}\n\nQuestion: {QUESTIONS[3]}\nAnswer:"
    context, rest = text_parts(tokenizer, prompt)
    assert context == tokenizer(DOCUMENT)["input_ids"]
    got = server.client().completions.create(model="tiny", prompt=prompt, max_tokens=MAX_TOKENS)
    assert got.usage.prompt_tokens == len(context) + len(rest)
    assert got.usage.completion_tokens == len(want.tokens) == MAX_TOKENS
    assert got.choices[0].text == want.text and got.choices[0].finish_reason == "length"


def test_eight_clients_at_once_get_the_answers_of_one_at_a_time(
    server: Server, fresh_answers: dict[str, str]
) -> None:
    got: dict[tuple[int, str], str] = {}

    def client(i: int) -> None:
        c = server.client()
        for q in (QUESTIONS[i], QUESTIONS[(i + 3) % 8]):
            got[i, q] = ask(c, q).choices[0].message.content

    threads = [threading.Thread(target=client, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert len(got) == 16
    assert all(text == fresh_answers[q] for (_, q), text in got.items())


def post(url: str, body: bytes, headers: dict[str, str] | None = None) -> tuple[int, dict]:
    """Status and JSON of a POST."""
    request = urllib.request.Request(url, body, {"Content-Type": "application/json",
                                                 **(headers or {})})  # fmt: skip
    try:
        with urllib.request.urlopen(request, timeout=60) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as err:
        return err.code, {**json.loads(err.read()), "headers": err.headers}


def test_bad_requests_get_openai_shaped_errors_without_a_traceback(server: Server) -> None:
    url = server.url + "/v1/chat/completions"
    status, body = post(url, b"{not json")
    assert status == 400 and "not JSON" in body["error"]["message"]
    status, body = post(url, json.dumps({"model": "tiny", "messages": []}).encode())
    assert status == 400 and body["error"]["param"] == "messages"
    message = [{"role": "user", "content": "hello there"}]
    status, body = post(url, json.dumps({"model": "gpt-9", "messages": message}).encode())
    assert status == 404 and body["error"]["code"] == "model_not_found"
    assert "tiny" in body["error"]["message"]
    with pytest.raises(openai.NotFoundError):
        server.client().chat.completions.create(model="gpt-9", messages=message)


def test_a_key_a_length_a_body_limit_and_a_full_queue_are_enforced(tiny_chat_model: str) -> None:
    s = Server(tiny_chat_model, "--api-key", "sesame", "--queue", "1", "--body-mib", "1",
               "--method", "fold")  # fmt: skip
    try:
        long = {"model": "tiny", "messages": [{"role": "user", "content": "word " * 5000}]}
        status, body = post(s.url + "/v1/chat/completions", json.dumps(long).encode(),
                            {"Authorization": "Bearer sesame"})  # fmt: skip
        assert status == 400 and "max_position_embeddings = 4096" in body["error"]["message"]
        assert body["error"]["code"] == "context_length_exceeded"
        with pytest.raises(openai.AuthenticationError):
            ask(s.client("wrong"), QUESTIONS[0])
        status, _ = post(s.url + "/v1/completions", b"{}")
        assert status == 401
        # a body declared past the limit is refused before it is read (sent whole here, as a
        # client that has written it all then reads the answer; one still writing may meet a
        # closed connection, as at any server that refuses it unread)
        declared = {"Authorization": "Bearer sesame", "Content-Length": str(2 << 20)}
        status, body = post(s.url + "/v1/completions", b"{}", declared)
        assert status == 413 and "1048576" in body["error"]["message"]
        client = s.client("sesame")
        assert ask(client, QUESTIONS[0]).choices[0].message.content is not None
        # a long sampled answer holds the worker; one request waits, the next is refused
        busy = ask(client, QUESTIONS[1], stream=True, max_tokens=3000, temperature=2.0)
        first = next(iter(busy))
        assert first.choices[0].delta.role == "assistant"
        s.wait_for(running=True, waiting=0)
        waiting = threading.Thread(target=ask, args=(client, QUESTIONS[2]))
        waiting.start()
        s.wait_for(running=True, waiting=1)
        message = {"model": "tiny", "messages": [{"role": "user", "content": "hi\n\nthere"}]}
        status, body = post(s.url + "/v1/chat/completions", json.dumps(message).encode(),
                            {"Authorization": "Bearer sesame"})  # fmt: skip
        assert status == 503 and int(body["headers"]["Retry-After"]) >= 1
        busy.close()  # the client leaves: its answer stops, the waiting one runs
        waiting.join(timeout=60)
        assert not waiting.is_alive()
    finally:
        code, err = s.stop()
    assert code == 0, err
    assert "Traceback" not in err
    answered = [int(n) for n in re.findall(r"(\d+) answered in", err)]
    assert len(answered) == 3 and answered[1] < 3000  # the client that left stopped its answer


def test_the_prompt_splits_where_ask_splits_document_and_question(tiny_chat_model: str) -> None:
    from longkv.document.prompt import document_ids, question_ids

    _, tokenizer = load_pretrained(tiny_chat_model)
    turn = [{"role": "user", "content": f"{DOCUMENT}\n\n{QUESTIONS[0]}"}]
    assert chat_parts(tokenizer, turn) == (
        document_ids(tokenizer, DOCUMENT),
        question_ids(tokenizer, QUESTIONS[0]),
    )
    system = [{"role": "system", "content": DOCUMENT}, {"role": "user", "content": "Why?"}]
    context, rest = chat_parts(tokenizer, system)
    assert tokenizer.decode(context).endswith(f"{DOCUMENT}\n<|user|>\n")
    assert tokenizer.decode(rest) == "Why?\n<|assistant|>\n"


def test_kept_reads_are_stored_and_a_restart_answers_from_them_as_before(
    tiny_chat_model: str, fresh_answers: dict[str, str], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    first = Server(tiny_chat_model, "--store", str(store))
    try:
        assert ask(first.client(), QUESTIONS[0]).usage.prompt_tokens_details.cached_tokens == 0
    finally:
        code, err = first.stop()
    assert code == 0 and "stopped on SIGTERM" in err, err
    assert len(list(store.glob("*.json"))) == 1 and len(list(store.iterdir())) == 2
    second = Server(tiny_chat_model, "--store", str(store))
    try:
        answer = ask(second.client(), QUESTIONS[1])
        assert answer.usage.prompt_tokens_details.cached_tokens > 0  # loaded, not read again
        assert answer.choices[0].message.content == fresh_answers[QUESTIONS[1]]
    finally:
        second.stop()


def test_a_store_killed_mid_save_or_damaged_never_loads_a_wrong_read(
    tiny_chat_model: str, fresh_answers: dict[str, str], tmp_path: Path
) -> None:
    store = tmp_path / "store"
    s = Server(tiny_chat_model, "--store", str(store))
    for i in range(3):  # each a new document, its read saved after its answer
        ask(s.client(), QUESTIONS[0], document=f"{DOCUMENT} Part {i}.")
    s.process.kill()  # SIGKILL, at once: the last save may be under way
    s.process.communicate(timeout=60)
    reads = sorted(p for p in store.iterdir() if p.is_dir() and not p.name.startswith("."))
    damaged = reads[0] / "tensors.pt"
    damaged.write_bytes(damaged.read_bytes()[:100])  # truncated
    (store / ".stray.saving-x").mkdir()  # a save that never finished
    s = Server(tiny_chat_model, "--store", str(store))
    try:
        for i in range(3):
            answer = ask(s.client(), QUESTIONS[1], document=f"{DOCUMENT} Part {i}.")
            message = answer.choices[0].message.content
            fresh = read_fresh(tiny_chat_model, f"{DOCUMENT} Part {i}.", QUESTIONS[1])
            assert message == fresh, i
    finally:
        code, err = s.stop()
    assert code == 0
    assert "dropped the kept read" in err and "removed .stray.saving-x" in err, err
    assert "Traceback" not in err


def read_fresh(model_dir: str, document: str, question: str) -> str:
    """The answer of a fresh read of document in this process (the fold, as the server reads)."""
    model, tokenizer = load_pretrained(model_dir)
    return read(model, tokenizer, document, "fold", progress=False).ask(question, MAX_TOKENS).text


class Browser:
    """Headless Chromium driven through chromedriver's WebDriver protocol (HTTP and JSON)."""

    ELEMENT = "element-6066-11e4-a52e-4f735466cecf"

    def __init__(self, driver: str, binary: str):
        self.port = free_port()
        quiet = {"stdout": subprocess.DEVNULL, "stderr": subprocess.DEVNULL}
        self.process = subprocess.Popen([driver, f"--port={self.port}"], **quiet)
        self.url = f"http://127.0.0.1:{self.port}"
        deadline = time.monotonic() + 30
        while not self.ready() and time.monotonic() < deadline:
            time.sleep(0.2)
        args = ["--headless=new", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage"]
        options = {"binary": binary, "args": args}
        caps = {"alwaysMatch": {"browserName": "chrome", "goog:chromeOptions": options}}
        self.session = self.call("POST", "/session", {"capabilities": caps})["sessionId"]

    def ready(self) -> bool:
        try:
            with urllib.request.urlopen(self.url + "/status", timeout=1):
                return True
        except OSError:
            return False

    def call(self, method: str, path: str, body: dict | None = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        request = urllib.request.Request(self.url + path, data, method=method,
                                         headers={"Content-Type": "application/json"})  # fmt: skip
        with urllib.request.urlopen(request, timeout=60) as r:
            return json.loads(r.read())["value"]

    def on(self, path: str, body: dict | None = None, method: str = "POST") -> Any:
        return self.call(method, f"/session/{self.session}{path}", body)

    def element(self, css: str) -> str:
        return self.on("/element", {"using": "css selector", "value": css})[self.ELEMENT]

    def close(self) -> None:
        try:
            self.on("", method="DELETE")
        finally:
            self.process.terminate()
            self.process.wait(timeout=30)


def test_the_page_asks_a_question_and_shows_the_answer_streamed(
    server: Server, fresh_answers: dict[str, str]
) -> None:
    import shutil

    driver, binary = shutil.which("chromedriver"), shutil.which("chromium")
    if driver is None or binary is None:
        assert not os.environ.get("CI"), "CI installs chromium and its driver (.ci/run)"
        pytest.skip("chromium and chromedriver are not installed (apt install chromium-driver)")
    browser = Browser(driver, binary)
    try:
        browser.on("/url", {"url": server.url + "/"})
        script = "document.getElementById('document').value = arguments[0];"
        browser.on("/execute/sync", {"script": script, "args": [DOCUMENT]})
        browser.on(f"/element/{browser.element('#question')}/value", {"text": QUESTIONS[4]})
        browser.on(f"/element/{browser.element('#ask')}/click", {})
        status = browser.element("#status")
        deadline = time.monotonic() + 60
        while "answer tokens" not in browser.on(f"/element/{status}/text", method="GET"):
            assert time.monotonic() < deadline, "the page showed no answer"
            time.sleep(0.2)
        shown = browser.on(f"/element/{browser.element('#answer')}/text", method="GET")
        assert shown.startswith(fresh_answers[QUESTIONS[4]].strip())  # 64 tokens, not 6
        said = browser.on(f"/element/{status}/text", method="GET")
        assert "prompt tokens" in said and "first token after" in said
    finally:
        browser.close()


def test_the_readmes_curl_and_openai_examples_answer_as_a_fresh_read(
    server: Server, tiny_chat_model: str, tmp_path: Path
) -> None:
    import shutil

    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    shell = next(b for b in re.findall(r"```bash\n(.*?)```", readme, re.S) if "longkv serve" in b)
    started, asked = shell.split("\n", 1)
    assert started == "longkv serve --port 8000 &"
    (py,) = re.findall(r"```py\n(.*?)```", readme, re.S)
    here = {"smollm2": "tiny", "localhost:8000": f"127.0.0.1:{server.port}",
            "127.0.0.1:8000": f"127.0.0.1:{server.port}"}  # fmt: skip
    for old, new in here.items():
        asked, py = asked.replace(old, new), py.replace(old, new)
    (tmp_path / "book.txt").write_text(DOCUMENT)
    model, tokenizer = load_pretrained(tiny_chat_model)
    doc = read(model, tokenizer, DOCUMENT, "fold", progress=False)
    runs = [([sys.executable, "-c", py], "Where is Netherfield?")]
    if shutil.which("jq") and shutil.which("curl"):
        runs.append((["bash", "-c", asked], "Who is Mr. Darcy?"))
    elif os.environ.get("CI"):
        raise AssertionError("the README's curl example needs jq and curl")
    for argv, question in runs:
        out = subprocess.run(argv, cwd=tmp_path, capture_output=True, text=True, check=True)
        assert out.stdout.strip() == doc.ask(question, 64).text.strip(), argv[0]


def test_bench_serve_sets_the_second_questions_first_token_against_the_first(
    tiny_chat_model: str, tmp_path: Path
) -> None:
    from longkv.bench.serve import ServeBenchSettings, run, write_page

    s = ServeBenchSettings(model=tiny_chat_model, tokens=300, clients=(1, 3), rounds=2,
                           max_tokens=4, threads=1, out_dir=str(tmp_path))  # fmt: skip
    report = run(s, ["bench", "serve"])
    assert report["first"]["cached_tokens"] == 0 < report["second"]["cached_tokens"]
    assert report["second"]["prompt_tokens"] > report["second"]["cached_tokens"] > 290
    assert report["first_token_ratio"] > 0
    assert [r["requests"] for r in report["loads"]] == [2, 6]
    assert all(r["all_from_kept"] and not r["failed"] for r in report["loads"])
    paths = write_page(report, s)
    assert [p.suffix for p in paths] == [".json", ".md", ".png"]
    assert "sooner than the first's" in paths[1].read_text()


def test_kept_reads_find_the_longest_begun_and_drop_the_least_recently_used(
    tiny_chat_model: str,
) -> None:
    from longkv.document.save import held_bytes
    from longkv.serve.kept import KeptReads

    model, tokenizer = load_pretrained(tiny_chat_model)
    ids = tokenizer(DOCUMENT)["input_ids"]
    short = read(model, tokenizer, ids[:100], "fold", progress=False)
    long = short.extend(ids[100:300])
    other = read(model, tokenizer, ids[300:500], "fold", progress=False)
    one = held_bytes(other.runner)
    dropped: list[object] = []
    kept = KeptReads(cap_bytes=held_bytes(short.runner, long.runner) + one // 2,
                     on_drop=dropped.append)  # fmt: skip
    assert kept.keep("fold", ids[:100], short) and kept.keep("fold", ids[:300], long)
    assert kept.find("fold", ids[:400]) == (long, 300)  # the longest that ids begin with
    assert kept.find("fold", ids[:250]) == (short, 100)  # short is now the most recent
    assert kept.find("infllm", ids[:400]) == (None, 0)  # another method's reads never match
    assert kept.find("fold", ids[1:400]) == (None, 0)
    assert kept.keep("fold", ids[300:500], other)  # past the cap: the least recent goes
    assert dropped == [("fold", tuple(ids[:300]))] and len(kept) == 2
    assert kept.bytes() <= kept.cap_bytes
    tiny = KeptReads(cap_bytes=one - 1)
    assert not tiny.keep("fold", ids[300:500], other) and len(tiny) == 0  # alone past the cap
