"""A test server's vLLM keeps its temporary files (`vllm_dist_*`, its ZMQ sockets) in the server's own folder,
which `VLLMServer.stop` removes: the real-vLLM suite leaves nothing in /tmp (it left one file and one socket per
server start before)."""

from __future__ import annotations

import os
import tempfile


def test_vllm_temporary_files_stay_in_the_servers_own_folder(vllm_server):
    own = [p.name for p in vllm_server.tmp.iterdir()]
    assert any(name.startswith("vllm_dist_") for name in own), own  # TMPDIR reached the server
    shared = tempfile.gettempdir()
    stray = [name for name in os.listdir(shared) if name.startswith("vllm_dist_")
             and os.stat(os.path.join(shared, name)).st_mtime >= vllm_server.started_at]  # fmt: skip
    assert not stray
