"""The KV of a handoff as files (`KvFiles`): written by a prefill runner, taken once by a decode
runner, from the same directory or, on another host, from the prefill runner's `KvFileServer`
over TCP; what comes back is bit for bit what was exported, and an engine adopting it generates
what the exporting engine generated. A file that is gone or cut short is None, not an error."""

from __future__ import annotations

import pytest
import torch

from sluice.actors.kv_handoff import KvFiles, KvFileServer, fetch
from sluice.engine import SamplingParams
from sluice.engine.kv_transfer import KvBlocks, export_prefix, import_prefix

from .helpers import tiny_engine

PROMPT = [(7 * j) % 97 + 2 for j in range(30)]
GREEDY = SamplingParams(temperature=0, max_tokens=6, ignore_eos=True)


@pytest.fixture(scope="module")
def exported(tmp_path_factory) -> tuple[KvBlocks, list[int], object]:
    """The prompt's KV from an engine that computed it, its tokens, and a fresh engine of the
    same weights to adopt it."""
    path = tmp_path_factory.mktemp("tiny")
    prefill = tiny_engine(path, 256)
    (out,) = prefill.generate(prompt_token_ids=[PROMPT], params=GREEDY, cache_salt="tenant")
    kv = export_prefix(prefill, PROMPT, "tenant")
    assert kv is not None and kv.num_tokens == 28  # 7 full blocks of 4
    return kv, out.token_ids, tiny_engine(path, 256)


def same(a: KvBlocks, b: KvBlocks) -> bool:
    return (
        a.hashes == b.hashes
        and a.block_size == b.block_size
        and all(torch.equal(x, y) and x.dtype == y.dtype for x, y in zip(a.tensors, b.tensors))
    )


def test_taken_from_another_hosts_server_it_is_what_was_exported(tmp_path, exported):
    kv, tokens, decode = exported
    prefill_files = KvFiles(str(tmp_path / "prefill-host"), owner="prefill-1")
    decode_files = KvFiles(str(tmp_path / "decode-host"), owner="decode-1")
    server = KvFileServer(prefill_files, "127.0.0.1:0")
    source = server.start()
    try:
        name = prefill_files.write(kv)
        back = decode_files.take(name, source)
        assert back is not None and same(back, kv)
        assert not (tmp_path / "prefill-host" / name).exists()  # taken once
        assert decode_files.take(name, source) is None  # a second time: gone
        assert import_prefix(decode, back) == kv.num_tokens
        (out,) = decode.generate(prompt_token_ids=[PROMPT], params=GREEDY, cache_salt="tenant")
        assert out.token_ids == tokens
        assert out.usage.cached_tokens == kv.num_tokens
    finally:
        server.stop()


def test_taken_from_a_shared_directory_without_a_server(tmp_path, exported):
    kv, _, _ = exported
    files = KvFiles(str(tmp_path), owner="prefill-1")
    name = files.write(kv)
    back = KvFiles(str(tmp_path), owner="decode-1").take(name)
    assert back is not None and same(back, kv)
    assert not list(tmp_path.iterdir())


def test_gone_or_cut_short_is_none(tmp_path, exported, caplog):
    kv, _, _ = exported
    files = KvFiles(str(tmp_path), owner="prefill-1")
    assert files.take("prefill-1-nothing.kv") is None
    name = files.write(kv)
    path = tmp_path / name
    path.write_bytes(path.read_bytes()[:-100])
    assert files.take(name) is None
    assert "ends early" in caplog.text
    assert not path.exists()
    assert files.take("../../etc/passwd") is None  # a name, never a path elsewhere


def test_a_server_with_no_such_file_answers_none(tmp_path):
    server = KvFileServer(KvFiles(str(tmp_path), owner="p"), "127.0.0.1:0")
    source = server.start()
    try:
        assert fetch(source, "p-missing.kv") is None
    finally:
        server.stop()
