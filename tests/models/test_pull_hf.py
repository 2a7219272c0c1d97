"""`kvlocal pull OWNER/REPO[:QUANT]` and hub specs as model arguments, against a hub served here.

A stdlib HTTP server on 127.0.0.1 answers the calls huggingface_hub makes: ``GET /api/models/{repo}``
(the listing: ``siblings``) and ``HEAD``/``GET /{repo}/resolve/{revision}/{file}`` (with
``X-Repo-Commit``, ``ETag``, ``Content-Length``, and the hub's ``X-Error-Code`` on errors). The CLI runs
in a subprocess with ``HF_ENDPOINT`` pointing at it and ``HF_HOME`` in tmp_path — huggingface_hub
reads both at import — so the whole path, HTTP included, is the one a user takes. The models are
tiny random-weight llama files (tests/reference/tiny_gguf.py) that the real llama.cpp loads."""

from __future__ import annotations

import hashlib
import json
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urlsplit

import pytest

from conftest import assert_usage_error, run_cli
from kvlocal.errors import UsageError
from kvlocal.models.hub import HubSpec, parse, pick

sys.path.insert(0, str(Path(__file__).parents[1] / "reference"))
import tiny_gguf  # noqa: E402

COMMIT = "0123456789abcdef0123456789abcdef01234567"
REPO = "kvtest/Tiny-GGUF"


class Hub(ThreadingHTTPServer):
    """repos: {repo_id: {path: bytes}}; gated: repo ids whose files need a token."""

    daemon_threads = True

    def __init__(self, repos: dict[str, dict[str, bytes]], gated=()):
        super().__init__(("127.0.0.1", 0), Handler)
        self.repos, self.gated, self.requests = repos, set(gated), []
        self.url = f"http://127.0.0.1:{self.server_address[1]}"
        threading.Thread(target=self.serve_forever, daemon=True).start()

    def stop(self):
        self.shutdown()
        self.server_close()


class Handler(BaseHTTPRequestHandler):
    server: Hub

    def log_message(self, *args):
        pass

    def do_HEAD(self):
        self.answer(body=False)

    def do_GET(self):
        self.answer(body=True)

    def send(self, status: int, data: bytes = b"", headers: dict | None = None, body: bool = True):
        self.send_response(status)
        for k, v in (headers or {}).items():
            self.send_header(k, v)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        if body:
            self.wfile.write(data)

    def answer(self, body: bool):
        path = unquote(urlsplit(self.path).path)
        self.server.requests.append(f"{self.command} {path}")
        parts = path.strip("/").split("/")
        if parts[:2] == ["api", "models"]:  # /api/models/{owner}/{name}[/revision/{rev}]
            repo = "/".join(parts[2:4])
            if repo not in self.server.repos:
                return self.send(404, b'{"error": "Repository not found"}', {"X-Error-Code": "RepoNotFound"}, body)
            info = {"id": repo, "sha": COMMIT, "siblings": [{"rfilename": f} for f in sorted(self.server.repos[repo])]}
            return self.send(200, json.dumps(info).encode(), {"Content-Type": "application/json"}, body)
        if len(parts) < 5 or parts[2] != "resolve":  # /{owner}/{name}/resolve/{rev}/{path...}
            return self.send(404, b"not found", {}, body)
        repo, file = "/".join(parts[:2]), "/".join(parts[4:])
        if repo not in self.server.repos:
            return self.send(404, b"Repository not found", {"X-Error-Code": "RepoNotFound"}, body)
        if repo in self.server.gated:
            return self.send(401, b"gated", {"X-Error-Code": "GatedRepo", "X-Error-Message": f"Access to model {repo} is restricted."}, body)
        data = self.server.repos[repo].get(file)
        if data is None:
            return self.send(404, b"Entry not found", {"X-Error-Code": "EntryNotFound", "X-Repo-Commit": COMMIT}, body)
        etag = f'"{hashlib.sha256(data).hexdigest()}"'
        self.send(200, data, {"X-Repo-Commit": COMMIT, "ETag": etag, "X-Linked-Etag": etag,
                              "Content-Type": "application/octet-stream"}, body)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> bytes:
    return tiny_gguf.write_tiny(tmp_path_factory.mktemp("tiny") / "tiny.gguf").read_bytes()


@pytest.fixture
def env(tmp_path, monkeypatch):
    """huggingface_hub's settings for the subprocess: its home in tmp_path, no token, no proxy for 127.0.0.1."""
    for k in ("HF_HUB_CACHE", "HUGGINGFACE_HUB_CACHE", "HF_HUB_OFFLINE", "HF_TOKEN", "HUGGING_FACE_HUB_TOKEN", "HF_TOKEN_PATH"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("NO_PROXY", "127.0.0.1,localhost")
    monkeypatch.setenv("no_proxy", "127.0.0.1,localhost")
    return {"HF_HOME": str(tmp_path / "hf"), "KVLOCAL_CACHE": str(tmp_path / "kvlocal"), "HF_HUB_DISABLE_TELEMETRY": "1"}


@pytest.fixture
def hub(tiny, env):
    """REPO with four quants (one in a folder), an imatrix twin of Q8_0 and a vision projector."""
    server = Hub({REPO: {"tiny-Q4_K_M.gguf": tiny, "tiny-Q4_K_S.gguf": tiny, "tiny-Q8_0.gguf": tiny,
                         "tiny-imat-Q8_0.gguf": tiny, "mmproj-tiny-f16.gguf": tiny, "f32/tiny-F32.gguf": tiny,
                         "README.md": b"# tiny\n"}})
    env["HF_ENDPOINT"] = server.url
    yield server
    server.stop()


def snapshot(env) -> Path:
    return Path(env["HF_HOME"]) / "hub" / f"models--{REPO.replace('/', '--')}" / "snapshots" / COMMIT


def test_pull_by_quant(hub, env, tiny):
    r = run_cli("pull", f"{REPO}:q4_k_m", env=env)
    assert r.returncode == 0, r.stderr
    path = Path(r.stdout.strip())
    assert path == snapshot(env) / "tiny-Q4_K_M.gguf" and path.read_bytes() == tiny
    assert "downloading tiny-Q4_K_M.gguf" in r.stderr
    assert not Path(env["KVLOCAL_CACHE"]).exists()  # the hub's cache, not kvlocal's
    assert f"HEAD /{REPO}/resolve/main/tiny-Q4_K_M.gguf" in hub.requests


def test_pull_a_file_in_a_folder(hub, env, tiny):
    r = run_cli("pull", "-q", f"{REPO}/f32/tiny-F32.gguf", env=env)
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()) == snapshot(env) / "f32" / "tiny-F32.gguf"
    assert r.stderr == ""


def test_a_bare_repo_means_its_q4_k_m_file(hub, env):
    r = run_cli("pull", "-q", f"hf:{REPO}", env=env)
    assert r.returncode == 0, r.stderr
    assert Path(r.stdout.strip()).name == "tiny-Q4_K_M.gguf"


def test_cached_file_is_used_offline(hub, env):
    """Pulled once; then the same spec works with the server gone, and with HF_HUB_OFFLINE without a request."""
    first = run_cli("pull", "-q", f"{REPO}:Q4_K_S", env=env)
    assert first.returncode == 0, first.stderr
    n = len(hub.requests)
    r = run_cli("pull", f"{REPO}:Q4_K_S", env={**env, "HF_HUB_OFFLINE": "1"})
    assert r.returncode == 0 and r.stdout == first.stdout, r.stderr
    assert len(hub.requests) == n
    hub.stop()
    r = run_cli("pull", f"{REPO}:Q4_K_S", env=env)
    assert r.returncode == 0 and r.stdout == first.stdout, r.stderr
    assert f"cannot reach {hub.url}" in r.stderr and "using the cached" in r.stderr
    assert_usage_error(run_cli("pull", f"{REPO}:Q4_K_M", env=env), "cannot reach", "has no file for")


def test_resolve_without_pulling_reads_the_cache_only(hub, env, monkeypatch):
    """resolve(pull_missing=False) never asks the hub: the cached file, else the command that pulls it."""
    from huggingface_hub import constants

    from kvlocal.models import resolve

    first = run_cli("pull", "-q", f"{REPO}:Q4_K_M", env=env)
    assert first.returncode == 0, first.stderr
    hub.stop()
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(Path(env["HF_HOME"]) / "hub"))  # read at import otherwise
    assert resolve(f"hf:{REPO}", pull_missing=False) == Path(first.stdout.strip())
    with pytest.raises(UsageError, match=f"run `kvlocal pull {REPO}:Q8_0`"):
        resolve(f"{REPO}:Q8_0", pull_missing=False)


def test_run_loads_the_pulled_model(hub, env, tmp_path):
    """A hub spec as the model argument: pulled on first use, then loaded by the real llama.cpp."""
    prompt = tmp_path / "prompt.txt"
    prompt.write_text("the cat sat on the mat and the dog sat on the log " * 4)
    r = run_cli("run", f"{REPO}/tiny-Q8_0.gguf", "--prompt-file", str(prompt),
                "-n", "4", "--json", "-t", "1", env=env)
    assert r.returncode == 0, r.stderr
    out = json.loads(r.stdout)
    assert out["generated_tokens"] == 4 and out["prompt_tokens"] > 20


def test_ambiguous_quant(hub, env):
    r = run_cli("pull", f"{REPO}:Q8_0", env=env)
    assert_usage_error(r, "'Q8_0' matches 2 files", "tiny-Q8_0.gguf", "tiny-imat-Q8_0.gguf", f"{REPO}/FILE.gguf")
    assert "mmproj" not in r.stderr


def test_unknown_quant_and_file(hub, env):
    assert_usage_error(run_cli("pull", f"{REPO}:Q4_K", env=env), "'Q4_K' matches no files", "tiny-Q4_K_M.gguf")
    assert_usage_error(run_cli("pull", f"{REPO}/nope.gguf", env=env), f"{REPO} has no file nope.gguf", "f32/tiny-F32.gguf")


def test_missing_repo(hub, env):
    assert_usage_error(run_cli("pull", "kvtest/No-Such-GGUF", env=env), "no repository kvtest/No-Such-GGUF", hub.url)


def test_gated_repo_names_the_token(tiny, env):
    server = Hub({"kvtest/Gated-GGUF": {"gated-Q4_K_M.gguf": tiny}}, gated={"kvtest/Gated-GGUF"})
    try:
        r = run_cli("pull", "kvtest/Gated-GGUF", env={**env, "HF_ENDPOINT": server.url})
    finally:
        server.stop()
    assert_usage_error(r, "kvtest/Gated-GGUF", "gated", "HF_TOKEN")


def test_not_a_gguf_is_removed_from_the_cache(env):
    server = Hub({"kvtest/Bad-GGUF": {"bad-Q4_K_M.gguf": b"<html>not a model</html>\n"}})
    try:
        r = run_cli("chat", "kvtest/Bad-GGUF", input="hello\n", env={**env, "HF_ENDPOINT": server.url})
    finally:
        server.stop()
    assert_usage_error(r, "kvtest/Bad-GGUF/bad-Q4_K_M.gguf is not a GGUF file", "removed from the hub cache")
    repo = Path(env["HF_HOME"]) / "hub" / "models--kvtest--Bad-GGUF"
    assert [p for p in (repo / "blobs").rglob("*") if not p.is_dir()] == []
    assert [p for p in (repo / "snapshots").rglob("*") if not p.is_dir()] == []


def test_split_gguf_is_refused(tiny, env):
    files = {f"big/big-F16-0000{i}-of-00002.gguf": tiny for i in (1, 2)}
    server = Hub({"kvtest/Split-GGUF": files})
    try:
        r = run_cli("pull", "kvtest/Split-GGUF:F16", env={**env, "HF_ENDPOINT": server.url})
    finally:
        server.stop()
    assert_usage_error(r, "split in 2 files", "llama-gguf-split --merge")


@pytest.mark.parametrize("arg, spec", [
    ("bartowski/Some-Model-GGUF", HubSpec("bartowski/Some-Model-GGUF")),
    ("o/r:q4_k_m", HubSpec("o/r", quant="q4_k_m")),
    ("o/r/sub/dir/m.Q8_0.gguf", HubSpec("o/r", file="sub/dir/m.Q8_0.gguf")),
    ("hf:o/r.gguf", HubSpec("o/r.gguf", forced=True)),
    ("smollm2-135m", None),  # a known name is never a repo
    ("models/m.gguf", None),  # a missing local file, not a repo
    ("./o/r", None), ("/o/r", None), ("o/r:", None), ("o/r:a:b", None),
    ("tests/conftest.py", None),  # exists here
])
def test_parse(arg, spec):
    assert parse(arg) == spec


def test_pick():
    files = ["a-Q4_K_M.gguf", "a-IQ4_XS.gguf", "a-Q4_0.gguf", "mmproj-a-f16.gguf", "x/a-Q4_0_4_4.gguf", "README.md"]
    assert pick(HubSpec("o/r", quant="q4_0"), files) == "a-Q4_0.gguf"  # not Q4_0_4_4
    assert pick(HubSpec("o/r"), files) == "a-Q4_K_M.gguf"
    assert pick(HubSpec("o/r"), ["only.F16.gguf", "mmproj-f16.gguf"]) == "only.F16.gguf"
    with pytest.raises(UsageError, match="name one as o/r:QUANT"):
        pick(HubSpec("o/r"), ["a-Q8_0.gguf", "a-F16.gguf"])
    with pytest.raises(UsageError, match="no .gguf model files"):
        pick(HubSpec("o/r"), ["model.safetensors"])
    with pytest.raises(UsageError, match="not a hub spec"):
        parse("hf:just-a-name")
