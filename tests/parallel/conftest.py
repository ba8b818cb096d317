"""The gloo rank tests' fork server, started once per test process with Hugging Face's decoders
imported (Note: [ranks from a fork server] in memfit/parallel/gloo.py).

Every rank of test_parallel_hf.py builds a transformers ``LlamaForCausalLM`` or
``Qwen3ForCausalLM``; importing their modules costs a rank about 4 s of CPU (measured on this
2-core machine: 4.1 s, against 1.8 s for torch and memfit.parallel.measure), and that file
forks 10 ranks or more. Imported once in the server, each rank inherits them. The server's
preload is the one ``spawn`` would give it plus these modules; ``spawn`` leaves a running
server as it is. Modules that fail to import are skipped by the server (transformers is
optional)."""

from __future__ import annotations

import multiprocessing

import pytest

HF_PRELOAD = ("transformers", "transformers.models.llama.modeling_llama",
              "transformers.models.qwen3.modeling_qwen3")


@pytest.fixture(scope="session", autouse=True)
def _fork_server_with_transformers() -> None:
    if "forkserver" not in multiprocessing.get_all_start_methods():
        return
    from multiprocessing import forkserver

    from memfit.parallel.gloo import PRELOAD

    multiprocessing.get_context("forkserver").set_forkserver_preload([*PRELOAD, *HF_PRELOAD])
    forkserver.ensure_running()
