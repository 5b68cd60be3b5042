"""OpenAI Python SDK compatibility suite for `processor serve`.

Drives a running service with the official `openai` package, changing only `base_url` and the
API key, as a user of OpenAI's Batch API would. Started by tests/serve_sdk.rs, which runs the
service against a real Redis, the dispatcher simulator and its gateway, and sets:

  OPENAI_BASE_URL   http://127.0.0.1:PORT/v1
  OPENAI_BASE_URLS  instead of OPENAI_BASE_URL: several replicas' base URLs, comma-separated
                    (they differ only in host:port); every request goes to the next one in turn
  KEY_A, KEY_B      API keys of two tenants
  SLOW_MAX_TOKENS   max_tokens that make one gateway answer take seconds (for the cancel check)
  MODEL             a model the service has a gateway for
  MISSING_MODEL     a model the service has no gateway for (its lines end as model_not_found)
  MAX_REQUESTS      the service's input.max_requests

Each check is named; the run prints one line per check, the traceback of each failure, and
"N passed, N failed" at the end, then one line `requests to <base url>: N` per base URL;
the exit code is 1 when any check failed. Names of check
functions as arguments run only those (`... test_openai_sdk.py check_upload check_create`).
"""

import itertools
import json
import os
import socket
import sys
import threading
import time
import traceback
import urllib.error
import urllib.request

import openai

try:  # the HTTP library under the SDK: httpx2 in openai 3, httpx before
    import httpx2 as httpx
except ImportError:
    import httpx

BASE_URLS = [u.strip().rstrip("/") for u in
             (os.environ.get("OPENAI_BASE_URLS") or os.environ["OPENAI_BASE_URL"]).split(",")
             if u.strip()]
# What the SDK is given; each request is then sent to the next of BASE_URLS.
BASE_URL = BASE_URLS[0]
KEY_A = os.environ["KEY_A"]
KEY_B = os.environ["KEY_B"]
SLOW_MAX_TOKENS = int(os.environ.get("SLOW_MAX_TOKENS", "5000"))
MISSING_MODEL = os.environ.get("MISSING_MODEL", "ghost")
MODEL = os.environ.get("MODEL", "llama-3")
ENDPOINT = "/v1/chat/completions"
# Long enough for a loaded 2-core machine; a healthy run takes a fraction of it.
POLL_LIMIT = float(os.environ.get("POLL_LIMIT_SECS", "180"))
TERMINAL = {"completed", "failed", "expired", "cancelled"}


class RoundRobin:
    """Hands out the base URLs in turn, and counts the requests each got."""

    def __init__(self, bases):
        paths = {httpx.URL(b).path for b in bases}
        assert len(paths) == 1, f"the base URLs differ in more than host:port: {bases}"
        self.bases = bases
        self.turn = itertools.cycle(range(len(bases)))
        self.counts = [0] * len(bases)
        self.lock = threading.Lock()

    def next(self):
        with self.lock:
            i = next(self.turn)
            self.counts[i] += 1
            return self.bases[i]


ROUND_ROBIN = RoundRobin(BASE_URLS)


class RoundRobinTransport(httpx.BaseTransport):
    """httpx's own transport, each request's host:port rewritten to the next base URL's."""

    def __init__(self):
        self.inner = httpx.HTTPTransport()

    def handle_request(self, request):
        target = httpx.URL(ROUND_ROBIN.next())
        request.url = request.url.copy_with(scheme=target.scheme, host=target.host,
                                            port=target.port)
        request.headers["Host"] = request.url.netloc.decode("ascii")
        return self.inner.handle_request(request)

    def close(self):
        self.inner.close()


def client(key):
    # No retries: a 5xx or a dropped connection is a finding, not something to paper over.
    return openai.OpenAI(base_url=BASE_URL, api_key=key, max_retries=0, timeout=60,
                         http_client=openai.DefaultHttpxClient(transport=RoundRobinTransport()))


A = client(KEY_A)
B = client(KEY_B)


# --- input files -----------------------------------------------------------------------------


def go_json(body):
    """The body as the dispatcher re-encodes it before sending (Go's encoding/json of the decoded
    value: keys sorted, compact, <, > and & escaped), whose digest the gateway then answers with."""
    text = json.dumps(json.loads(body), sort_keys=True, separators=(",", ":"), ensure_ascii=False)
    for char, escaped in (("<", "\\u003c"), (">", "\\u003e"), ("&", "\\u0026"),
                          ("\u2028", "\\u2028"), ("\u2029", "\\u2029")):
        text = text.replace(char, escaped)
    return text.encode()


def fnv1a_64(data):
    """The gateway simulator answers a body with id chatcmpl-<FNV-1a 64 of its bytes, hex>."""
    h = 0xCBF29CE484222325
    for byte in data:
        h ^= byte
        h = (h * 0x100000001B3) & 0xFFFFFFFFFFFFFFFF
    return f"{h:016x}"


def request_line(custom_id, model, max_tokens, text):
    """One input line, and the exact bytes of its body (what the gateway sees)."""
    body = json.dumps(
        {
            "model": model,
            "messages": [
                {"role": "system", "content": "You are terse."},
                {"role": "user", "content": text},
            ],
            "max_tokens": max_tokens,
        },
        separators=(",", ":"),
    )
    line = '{"custom_id":%s,"method":"POST","url":"%s","body":%s}' % (
        json.dumps(custom_id),
        ENDPOINT,
        body,
    )
    return line, body


def jsonl(lines):
    return ("\n".join(lines) + "\n").encode()


def upload(c, name, data, **kwargs):
    return c.files.create(file=(name, data, "application/jsonl"), purpose="batch", **kwargs)


def wait_for(c, batch_id, done, what, limit=POLL_LIMIT):
    """Polls the batch every 200 ms until `done(batch)`; fails naming what it waited for."""
    deadline = time.monotonic() + limit
    while True:
        batch = c.batches.retrieve(batch_id)
        if done(batch):
            return batch
        if batch.status in TERMINAL:
            raise AssertionError(f"{batch_id} ended {batch.status} while waiting for {what}: {batch}")
        if time.monotonic() > deadline:
            raise AssertionError(f"{batch_id} still {batch.status} after {limit}s waiting for {what}")
        time.sleep(0.2)


def wait_terminal(c, batch_id, limit=POLL_LIMIT):
    deadline = time.monotonic() + limit
    while True:
        batch = c.batches.retrieve(batch_id)
        if batch.status in TERMINAL:
            return batch
        if time.monotonic() > deadline:
            raise AssertionError(f"{batch_id} still {batch.status} after {limit}s")
        time.sleep(0.2)


def read_jsonl(c, file_id):
    """The lines of a file, parsed; [] for no file (OpenAI's null output/error file)."""
    if file_id is None:
        return []
    text = c.files.content(file_id).text
    assert text == "" or text.endswith("\n"), f"{file_id} does not end with a newline"
    return [json.loads(l) for l in text.splitlines()]


def x_counts(batch):
    counts = (batch.model_extra or {}).get("x_request_counts")
    assert isinstance(counts, dict), f"no x_request_counts on {batch.id}: {batch.model_extra}"
    for key in ("processing", "succeeded", "errored", "cancelled", "expired"):
        assert isinstance(counts.get(key), int), f"x_request_counts.{key} missing: {counts}"
    return counts


def check_each_once(custom_ids, output, errors):
    """Every custom_id of the input exactly once across the output and error lines."""
    seen = {}
    for line in output + errors:
        seen[line["custom_id"]] = seen.get(line["custom_id"], 0) + 1
    doubled = sorted(k for k, n in seen.items() if n > 1)
    assert not doubled, f"custom_ids written more than once: {doubled[:10]}"
    missing = sorted(set(custom_ids) - set(seen))
    assert not missing, f"custom_ids with no line: {missing[:10]} ({len(missing)} in all)"
    unknown = sorted(set(seen) - set(custom_ids))
    assert not unknown, f"lines for unknown custom_ids: {unknown[:10]}"


def expect_status(status, call, what):
    try:
        call()
    except openai.APIStatusError as e:
        assert e.status_code == status, f"{what}: got {e.status_code}, wanted {status}: {e}"
        error = e.body if isinstance(e.body, dict) else None
        assert error and isinstance(error.get("message"), str), (
            f"{what}: the error body is not OpenAI's {{error: {{message, type, param, code}}}}: {e.body}"
        )
        for key in ("type", "param", "code"):
            assert key in error, f"{what}: error.{key} missing: {e.body}"
        return e
    raise AssertionError(f"{what}: succeeded, wanted HTTP {status}")


def raw_get(path, key=None):
    """GET without the SDK, to the next base URL: (status, headers, body bytes)."""
    request = urllib.request.Request(ROUND_ROBIN.next() + path)
    if key is not None:
        request.add_header("Authorization", f"Bearer {key}")
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, response.headers, response.read()
    except urllib.error.HTTPError as e:
        return e.code, e.headers, e.read()


# --- checks ----------------------------------------------------------------------------------

state = {}


def check_upload():
    lines, bodies = [], {}
    for i in range(40):
        custom_id = f"req-{i}"
        # Every tenth line names a model without a gateway: it must end in the error file.
        model = MISSING_MODEL if i % 10 == 9 else MODEL
        line, body = request_line(custom_id, model, 1, f"question number {i}")
        lines.append(line)
        bodies[custom_id] = (model, body)
    data = jsonl(lines)
    f = upload(A, "input.jsonl", data)
    assert f.id.startswith("file-"), f.id
    assert f.object == "file" and f.purpose == "batch", f
    assert f.bytes == len(data), f"bytes {f.bytes}, uploaded {len(data)}"
    assert f.filename == "input.jsonl", f.filename
    assert isinstance(f.created_at, int) and f.created_at > 0, f.created_at
    again = A.files.retrieve(f.id)
    assert (again.id, again.bytes, again.filename) == (f.id, f.bytes, f.filename), again
    assert A.files.content(f.id).content == data, "content differs from the upload"
    assert f.id in [x.id for x in A.files.list()], "the upload is not listed"
    state["input"] = f
    state["bodies"] = bodies


def check_create():
    f = state["input"]
    batch = A.batches.create(
        input_file_id=f.id,
        endpoint=ENDPOINT,
        completion_window="5m",
        metadata={"suite": "openai-sdk", "check": "create"},
    )
    assert batch.id.startswith("batch_"), batch.id
    assert batch.object == "batch", batch
    assert batch.input_file_id == f.id and batch.endpoint == ENDPOINT, batch
    assert batch.completion_window == "5m", batch.completion_window
    assert batch.metadata == {"suite": "openai-sdk", "check": "create"}, batch.metadata
    assert batch.status in {"validating", "in_progress", "finalizing", "completed"}, batch.status
    assert batch.created_at > 0 and batch.expires_at and batch.expires_at > batch.created_at, batch
    x_counts(batch)
    state["batch"] = batch


def check_poll_to_completed():
    batch = wait_terminal(A, state["batch"].id)
    assert batch.status == "completed", f"status {batch.status}: {batch}"
    counts = batch.request_counts
    assert (counts.total, counts.completed, counts.failed) == (40, 36, 4), counts
    x = x_counts(batch)
    assert (x["processing"], x["succeeded"], x["errored"], x["cancelled"], x["expired"]) == (
        0, 36, 4, 0, 0), x
    times = [batch.created_at, batch.in_progress_at, batch.finalizing_at, batch.completed_at]
    assert all(isinstance(t, int) for t in times) and times == sorted(times), (
        f"created_at, in_progress_at, finalizing_at, completed_at: {times}")
    assert batch.output_file_id and batch.error_file_id, batch
    assert batch.errors is None or not batch.errors.data, batch.errors
    state["batch"] = batch


def check_output_and_error_files():
    batch = state["batch"]
    bodies = state["bodies"]
    for file_id in (batch.output_file_id, batch.error_file_id):
        f = A.files.retrieve(file_id)
        assert f.purpose == "batch_output", f"{file_id}: purpose {f.purpose}"
        assert f.id.startswith("file-"), f.id
    output = read_jsonl(A, batch.output_file_id)
    errors = read_jsonl(A, batch.error_file_id)
    check_each_once(list(bodies), output, errors)
    ids = set()
    for line in output:
        model, body = bodies[line["custom_id"]]
        assert model == MODEL, f"{line['custom_id']} ({model}) is in the output file: {line}"
        assert line["error"] is None, line
        response = line["response"]
        assert response["status_code"] == 200, line
        assert isinstance(response["request_id"], str), line
        answer = response["body"]
        assert answer["id"] in (f"chatcmpl-{fnv1a_64(body.encode())}",
                                f"chatcmpl-{fnv1a_64(go_json(body))}"), (
            f"{line['custom_id']} got the answer of another request: {answer['id']}")
        assert answer["object"] == "chat.completion" and answer["choices"], answer
        ids.add(line["id"])
    for line in errors:
        model, _ = bodies[line["custom_id"]]
        assert model == MISSING_MODEL, f"{line['custom_id']} ({model}) is in the error file: {line}"
        assert line["response"] is None, line
        assert line["error"]["code"] == "model_not_found", line
        assert isinstance(line["error"]["message"], str), line
        ids.add(line["id"])
    assert len(ids) == len(output) + len(errors), "line ids are not unique"
    assert len(output) == 36 and len(errors) == 4, (len(output), len(errors))
    state["output"], state["errors"] = output, errors


def check_partial_results_endpoints():
    """The extension: /v1/batches/{id}/output and /errors serve the lines written so far."""
    batch = state["batch"]
    for route, key in (("output", "output"), ("errors", "errors")):
        status, headers, body = raw_get(f"/batches/{batch.id}/{route}", KEY_A)
        assert status == 200, f"/batches/{batch.id}/{route}: HTTP {status}: {body[:300]!r}"
        lines = [json.loads(l) for l in body.decode().splitlines()]
        assert sorted(l["custom_id"] for l in lines) == sorted(
            l["custom_id"] for l in state[key]), f"/{route} differs from the {key} file"


def check_request_id_header():
    raw = A.batches.with_raw_response.retrieve(state["batch"].id)
    assert raw.headers.get("x-request-id"), f"no x-request-id: {dict(raw.headers)}"
    raw = A.files.with_raw_response.list(extra_headers={"x-request-id": "sdk-suite-42"})
    assert raw.headers.get("x-request-id") == "sdk-suite-42", dict(raw.headers)


def check_invalid_file_fails_with_line_numbers():
    good_1, _ = request_line("ok-1", MODEL, 1, "fine")
    good_3, _ = request_line("ok-3", MODEL, 1, "fine too")
    bad_lines = [
        good_1,                                                     # 1
        "this is not json",                                         # 2
        good_3,                                                     # 3
        json.dumps({"method": "POST", "url": ENDPOINT,              # 4: no custom_id
                    "body": {"model": MODEL, "messages": []}}),
        request_line("ok-1", MODEL, 1, "the same custom_id")[0],    # 5: duplicate custom_id
        json.dumps({"custom_id": "get", "method": "GET", "url": ENDPOINT,  # 6: not POST
                    "body": {"model": MODEL, "messages": []}}),
    ]
    f = upload(A, "invalid.jsonl", jsonl(bad_lines))
    batch = A.batches.create(input_file_id=f.id, endpoint=ENDPOINT, completion_window="5m")
    batch = wait_terminal(A, batch.id)
    assert batch.status == "failed", f"status {batch.status}: {batch}"
    assert batch.failed_at, batch
    assert batch.errors and batch.errors.data, f"no errors listed: {batch}"
    lines = sorted({e.line for e in batch.errors.data if e.line is not None})
    # Line 1 may be named too, as the first holder of the duplicated custom_id; line 3 is fine.
    assert {2, 4, 5, 6} <= set(lines) <= {1, 2, 4, 5, 6}, (
        f"error lines {lines}, wanted 2, 4, 5 and 6: {batch.errors.data}")
    for e in batch.errors.data:
        assert e.code and e.message, e
    assert batch.output_file_id is None, f"a failed validation wrote output: {batch}"


def check_401_without_key():
    status, headers, body = raw_get("/batches")
    assert status == 401, f"no Authorization header: HTTP {status}, wanted 401"
    error = json.loads(body)["error"]
    assert isinstance(error["message"], str), body
    assert headers.get("x-request-id"), "a 401 without x-request-id"
    status, _, _ = raw_get("/files", key="")
    assert status == 401, f"an empty key: HTTP {status}, wanted 401"
    wrong = client("sk-not-a-key")
    expect_status(401, lambda: wrong.batches.list(), "batches.list with a wrong key")
    try:
        wrong.batches.retrieve(state["batch"].id)
    except openai.AuthenticationError:
        pass
    else:
        raise AssertionError("batches.retrieve with a wrong key did not raise AuthenticationError")
    # An upload refused before its body is read: on a client of its own, since what happens to
    # its connection afterwards is the next check's business.
    expect_status(401, lambda: client("sk-not-a-key").files.create(
        file=("x.jsonl", b"{}\n"), purpose="batch"), "files.create with a wrong key")


def check_a_refused_upload_leaves_a_usable_connection():
    """An answer sent before the request's body is read (a 401 on an upload) must either say
    `Connection: close` or leave the connection usable: a pooled client (the SDK's httpx) sends
    its next request on it. Here the body comes 300 ms after the headers, as from a slow client;
    the SDK hits the same race now and then with a body sent at once."""
    base = ROUND_ROBIN.next()  # both requests go on one connection: counted once
    host, port = base.split("//", 1)[1].split("/", 1)[0].rsplit(":", 1)
    prefix = "/" + base.split("//", 1)[1].split("/", 1)[1]
    body = (b'--XX\r\nContent-Disposition: form-data; name="purpose"\r\n\r\nbatch\r\n'
            b'--XX\r\nContent-Disposition: form-data; name="file"; filename="x.jsonl"\r\n\r\n'
            b'{}\n\r\n--XX--\r\n')
    head = (f"POST {prefix}/files HTTP/1.1\r\nHost: {host}:{port}\r\n"
            "Authorization: Bearer sk-not-a-key\r\n"
            "Content-Type: multipart/form-data; boundary=XX\r\n"
            f"Content-Length: {len(body)}\r\n\r\n").encode()
    with socket.create_connection((host, int(port)), timeout=30) as s:
        s.sendall(head)
        time.sleep(0.3)
        s.sendall(body)
        first = read_response(s)
        assert first.startswith(b"HTTP/1.1 401"), f"the refused upload got {first[:100]!r}"
        if b"\r\nconnection: close\r\n" in first.lower():
            return  # announced: a client opens a new connection
        time.sleep(0.3)
        try:
            s.sendall(f"GET {prefix}/batches HTTP/1.1\r\nHost: {host}:{port}\r\n\r\n".encode())
            second = read_response(s)
        except OSError as e:
            second = repr(e).encode()
        assert second.startswith(b"HTTP/1.1 401"), (
            "the service closed the connection after answering 401 to an upload whose body it "
            "had not read, without `Connection: close`; the next request on it got "
            f"{second[:100]!r} (the SDK raises APIConnectionError: Server disconnected)")


def read_response(s):
    """The status line and headers of one HTTP response, or what came before the socket shut."""
    data = b""
    while b"\r\n\r\n" not in data:
        chunk = s.recv(65536)
        if not chunk:
            return data + b"<connection closed>"
        data += chunk
    return data


def check_404_for_another_tenants_objects():
    batch, f = state["batch"], state["input"]
    expect_status(404, lambda: B.batches.retrieve(batch.id), "B retrieves A's batch")
    expect_status(404, lambda: B.batches.cancel(batch.id), "B cancels A's batch")
    expect_status(404, lambda: B.files.retrieve(f.id), "B retrieves A's file")
    expect_status(404, lambda: B.files.content(f.id), "B downloads A's file")
    expect_status(404, lambda: B.files.content(batch.output_file_id), "B downloads A's output")
    expect_status(404, lambda: B.files.delete(f.id), "B deletes A's file")
    # The batch gateway's suite wants 400 for a batch of a file the caller cannot see: the
    # same answer as for a file that does not exist, so nothing tells B that A's file is there.
    expect_status(400, lambda: B.batches.create(
        input_file_id=f.id, endpoint=ENDPOINT, completion_window="5m"),
        "B makes a batch of A's file")
    status, _, _ = raw_get(f"/batches/{batch.id}/output", KEY_B)
    assert status == 404, f"B reads A's partial output: HTTP {status}"
    assert batch.id not in [b.id for b in B.batches.list()], "B lists A's batch"
    assert f.id not in [x.id for x in B.files.list()], "B lists A's file"
    # Still there for A.
    assert A.files.retrieve(f.id).id == f.id
    expect_status(404, lambda: A.batches.retrieve("batch_does_not_exist"), "an unknown batch")
    expect_status(404, lambda: A.files.retrieve("file-does-not-exist"), "an unknown file")


def check_cancel_a_running_batch():
    n = 200
    lines = [request_line(f"slow-{i}", MODEL, SLOW_MAX_TOKENS, f"take your time {i}")[0]
             for i in range(n)]
    f = upload(A, "slow.jsonl", jsonl(lines))
    batch = A.batches.create(input_file_id=f.id, endpoint=ENDPOINT, completion_window="10m")
    # The first answers (after SLOW_MAX_TOKENS ms each) are counted, and served, while it runs.
    running = wait_for(A, batch.id, lambda b: b.status == "in_progress" and b.request_counts.completed > 0,
                       "in_progress with answers counted")
    status, _, text = raw_get(f"/batches/{batch.id}/output", KEY_A)
    assert status == 200, f"/batches/{batch.id}/output while running: HTTP {status}"
    so_far = [json.loads(l) for l in text.decode().splitlines()]
    assert so_far, f"no output lines while running, with {running.request_counts.completed} counted"
    assert all(l["custom_id"].startswith("slow-") and l["response"]["status_code"] == 200
               for l in so_far), so_far[:3]
    cancelling = A.batches.cancel(batch.id)
    assert cancelling.status in {"cancelling", "cancelled"}, f"cancel answered {cancelling.status}"
    assert cancelling.cancelling_at, cancelling
    batch = wait_terminal(A, batch.id)
    assert batch.status == "cancelled", f"status {batch.status}: {batch}"
    assert batch.cancelling_at and batch.cancelled_at and batch.cancelled_at >= batch.cancelling_at, (
        f"cancelling_at {batch.cancelling_at}, cancelled_at {batch.cancelled_at}")
    output = read_jsonl(A, batch.output_file_id)
    errors = read_jsonl(A, batch.error_file_id)
    check_each_once([f"slow-{i}" for i in range(n)], output, errors)
    cancelled = [e for e in errors if e["error"]["code"] == "batch_cancelled"]
    assert cancelled, f"no batch_cancelled line: {len(output)} answered, {len(errors)} errors"
    assert len(output) < n, "every line was answered: the batch was not running when cancelled"
    for line in output:
        assert line["response"]["status_code"] == 200, line
    counts = batch.request_counts
    assert counts.total == n and counts.completed == len(output), counts
    x = x_counts(batch)
    assert x["cancelled"] == len(cancelled) and x["processing"] == 0, x
    # Cancelling a finished batch changes nothing.
    try:
        again = A.batches.cancel(batch.id)
        assert again.status == "cancelled", again.status
    except openai.BadRequestError:
        pass  # OpenAI answers 400 for a batch that cannot be cancelled any more
    # ... nor does cancelling a completed one.
    try:
        done = A.batches.cancel(state["batch"].id)
        assert done.status == "completed", f"cancelling a completed batch made it {done.status}"
    except openai.BadRequestError:
        pass


def check_list_250_batches_page_by_page():
    line, _ = request_line("only", MODEL, 1, "one line")
    f = upload(B, "one.jsonl", jsonl([line]))
    before = {b.id for b in B.batches.list()}
    created = []
    for i in range(250):
        b = B.batches.create(input_file_id=f.id, endpoint=ENDPOINT, completion_window="5m",
                             metadata={"n": str(i)})
        created.append(b.id)
    assert len(set(created)) == 250, "batch ids repeat"
    # The SDK's auto-pagination: 20 a page, `after` = the last id, until has_more is false.
    seen = [b.id for b in B.batches.list()]
    assert len(seen) == len(set(seen)), f"{len(seen) - len(set(seen))} batches listed twice"
    assert set(seen) == before | set(created), (
        f"listed {len(seen)}, missing {len(set(created) - set(seen))}, "
        f"unexpected {len(set(seen) - before - set(created))}")
    # Newest first, as OpenAI.
    newest_first = [x for x in seen if x in set(created)]
    assert newest_first == created[::-1], "not listed newest first"
    # Page by page, by hand.
    page = B.batches.list(limit=100)
    sizes = [len(page.data)]
    while page.has_next_page():
        page = page.get_next_page()
        sizes.append(len(page.data))
    assert sum(sizes) == len(seen) and sizes[:2] == [100, 100], f"page sizes {sizes}"
    assert page.has_more is False, f"the last page says has_more={page.has_more}"
    # A sees none of them.
    assert not set(created) & {b.id for b in A.batches.list()}, "A lists B's batches"


def check_an_upload_over_the_limit_gets_413():
    """The harness sets input.max_requests to MAX_REQUESTS: one line more is refused with 413,
    which the SDK must see as such (not as a reset connection it would retry)."""
    limit = int(os.environ["MAX_REQUESTS"])
    lines = [request_line(f"big-{i}", MODEL, 1, "x")[0] for i in range(limit + 1)]
    e = expect_status(413, lambda: upload(A, "too-many.jsonl", jsonl(lines)),
                      f"uploading {limit + 1} lines over a limit of {limit}")
    assert str(limit) in e.body["message"], f"the 413 does not name the limit: {e.body}"
    # The same client goes on working, and nothing of the refused upload is listed.
    assert "too-many.jsonl" not in [f.filename for f in A.files.list()], "the refused upload is listed"


def check_files_list_pages():
    everything = [f.id for f in A.files.list()]
    assert len(everything) >= 4, f"only {len(everything)} files to page through"
    assert len(everything) == len(set(everything)), "files listed twice"
    page = A.files.list(limit=2)
    paged = [f.id for f in page.data]
    while page.has_next_page():
        page = page.get_next_page()
        assert len(page.data) <= 2, f"a page of {len(page.data)} with limit=2"
        paged.extend(f.id for f in page.data)
    assert paged == everything, f"limit=2 pages give {paged}, one listing {everything}"
    ascending = [f.id for f in A.files.list(order="asc")]
    assert ascending == everything[::-1], "order=asc is not the reverse of the default order"
    outputs = [f for f in A.files.list(purpose="batch_output")]
    assert outputs and all(f.purpose == "batch_output" for f in outputs), outputs


def check_delete_a_file():
    f = state["input"]
    deleted = A.files.delete(f.id)
    assert deleted.id == f.id and deleted.deleted is True, deleted
    expect_status(404, lambda: A.files.retrieve(f.id), "retrieving a deleted file")
    expect_status(404, lambda: A.files.content(f.id), "downloading a deleted file")
    expect_status(404, lambda: A.files.delete(f.id), "deleting a deleted file")
    assert f.id not in [x.id for x in A.files.list()], "a deleted file is listed"
    # The batch made from it is still there, with its results.
    batch = A.batches.retrieve(state["batch"].id)
    assert batch.status == "completed", batch.status
    assert len(read_jsonl(A, batch.output_file_id)) == len(state["output"])


def check_an_expiring_file_is_reaped():
    f = upload(A, "short-lived.jsonl", jsonl([request_line("x", MODEL, 1, "soon gone")[0]]),
               expires_after={"anchor": "created_at", "seconds": 1})
    assert f.expires_at and f.expires_at - f.created_at == 1, f
    deadline = time.monotonic() + 60
    while True:
        try:
            A.files.retrieve(f.id)
        except openai.NotFoundError:
            return
        assert time.monotonic() < deadline, f"{f.id} still there 60 s after it expired"
        time.sleep(0.2)


def start_receiver(fail_first):
    """A webhook receiver on 127.0.0.1: records every POST, answers 500 to the first
    `fail_first` and 200 to the rest."""
    import http.server

    got, lock = [], threading.Lock()

    class Handler(http.server.BaseHTTPRequestHandler):
        def do_POST(self):
            body = self.rfile.read(int(self.headers.get("content-length", "0")))
            with lock:
                status = 500 if len(got) < fail_first else 200
                got.append((dict(self.headers.items()), body, status))
            self.send_response(status)
            self.send_header("content-length", "0")
            self.end_headers()

        def log_message(self, *args):
            pass

    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    return server, got, f"http://127.0.0.1:{server.server_address[1]}/hook"


def wait_deliveries(got, n, limit=60):
    deadline = time.monotonic() + limit
    while len(got) < n:
        assert time.monotonic() < deadline, f"{len(got)} deliveries after {limit} s, expected {n}"
        time.sleep(0.1)


def check_webhooks():
    server, got, url = start_receiver(3)
    try:
        expect_status(400, lambda: A.webhooks.create(url="https://evil.example.org/hook", name="x",
                                                     event_types=["batch.completed"]),
                      "a url outside serve.webhooks.allowed_hosts")
        ep = A.webhooks.create(url=url, name="sdk", event_types=["batch.completed", "batch.failed"])
        secret = ep.signing_secret
        assert secret.startswith("whsec_") and ep.object == "webhook_endpoint", ep
        listed = [e for e in A.webhooks.list()]
        assert ep.id in [e.id for e in listed], listed
        assert all(secret[6:] not in e.model_dump_json() for e in listed), "a listing shows the secret"
        assert ep.id not in [e.id for e in B.webhooks.list()], "another tenant lists it"
        expect_status(404, lambda: B.webhooks.retrieve(ep.id), "another tenant's webhook endpoint")
        assert A.webhooks.retrieve(ep.id).url == url
        assert A.webhooks.update(ep.id, name="sdk-renamed").name == "sdk-renamed"

        # A batch ends: the receiver fails three times and gets it the fourth, one id throughout.
        f = upload(A, "hooked.jsonl", jsonl([request_line("hook-0", MODEL, 1, "ping")[0]]))
        b = A.batches.create(input_file_id=f.id, endpoint=ENDPOINT, completion_window="24h")
        assert wait_terminal(A, b.id).status == "completed"
        wait_deliveries(got, 4)
        assert [s for _, _, s in got] == [500, 500, 500, 200], [s for _, _, s in got]
        assert len({h["webhook-id"] for h, _, _ in got}) == 1, "the id changed between attempts"
        for headers, body, _ in got:
            event = A.webhooks.unwrap(body, headers, secret=secret)
            assert event.type == "batch.completed" and event.data.id == b.id, event
        time.sleep(1.5)
        assert len(got) == 4, f"{len(got)} deliveries of a delivered event"

        rotated = A.webhooks.rotate_secret(ep.id)
        assert rotated.signing_secret != secret and rotated.signing_secret.startswith("whsec_")
        result = A.webhooks.test(ep.id, event_type="batch.failed")
        assert result.status_code == 200 and result.success, result
        headers, body, _ = got[-1]
        event = A.webhooks.unwrap(body, headers, secret=rotated.signing_secret)
        assert event.type == "batch.failed", event
        try:
            A.webhooks.unwrap(body, headers, secret=secret)
        except openai.InvalidWebhookSignatureError:
            pass
        else:
            raise AssertionError("the old secret still verifies after rotation")

        deleted = A.webhooks.delete(ep.id)
        assert deleted.deleted and deleted.id == ep.id, deleted
        assert ep.id not in [e.id for e in A.webhooks.list()], "a deleted endpoint is listed"
    finally:
        server.shutdown()


CHECKS = [
    ("upload a batch input file", check_upload),
    ("create a batch", check_create),
    ("poll the batch to completed", check_poll_to_completed),
    ("download the output and error files, check every line", check_output_and_error_files),
    ("partial results endpoints serve the same lines", check_partial_results_endpoints),
    ("responses carry x-request-id", check_request_id_header),
    ("an invalid file fails with line numbers", check_invalid_file_fails_with_line_numbers),
    ("401 without a key", check_401_without_key),
    ("a refused upload leaves a usable connection", check_a_refused_upload_leaves_a_usable_connection),
    ("404 for another tenant's batch and file", check_404_for_another_tenants_objects),
    ("cancel a running batch", check_cancel_a_running_batch),
    ("list 250 batches page by page to the end", check_list_250_batches_page_by_page),
    ("an upload over the limit gets 413", check_an_upload_over_the_limit_gets_413),
    ("files are listed page by page, in both orders, by purpose", check_files_list_pages),
    ("delete a file", check_delete_a_file),
    ("an expiring file is reaped", check_an_expiring_file_is_reaped),
    ("webhooks: created, listed, delivered, verified, rotated, tested, deleted", check_webhooks),
]


def main():
    only = set(sys.argv[1:])
    passed, failed = 0, []
    print(f"openai {openai.__version__} against {', '.join(BASE_URLS)}", flush=True)
    for name, check in CHECKS:
        if only and check.__name__ not in only:
            continue
        started = time.monotonic()
        try:
            check()
        except Exception:  # one failed check must not hide the others
            failed.append(name)
            print(f"FAIL  {name} ({time.monotonic() - started:.1f}s)", flush=True)
            traceback.print_exc(file=sys.stdout)
            sys.stdout.flush()
        else:
            passed += 1
            print(f"ok    {name} ({time.monotonic() - started:.1f}s)", flush=True)
    print(f"sdk: {passed} passed, {len(failed)} failed")
    for name in failed:
        print(f"  failed: {name}")
    for base, n in zip(ROUND_ROBIN.bases, ROUND_ROBIN.counts):
        print(f"requests to {base}: {n}")
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
