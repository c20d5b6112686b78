import asyncio
import os
import sys

import pytest

# Without a GPU, Triton kernels run in its interpreter; that must be chosen before any kernel
# module imports triton. (torch itself does not import triton.)
import torch  # noqa: E402

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory):
    """The small random checkpoint (official layout, FP8, MTP), written once per session."""
    from glm5next.checkpoint.writer import make_tiny_checkpoint

    path = str(tmp_path_factory.mktemp("tiny"))
    make_tiny_checkpoint(path, seed=0)
    return path


@pytest.fixture(scope="session")
def tiny_fp32(tiny_dir):
    """The small model loaded in fp32 on CPU."""
    import torch

    from glm5next.model.backbone import Glm5NextModel

    return Glm5NextModel.from_pretrained(tiny_dir, torch.float32, "cpu", progress=False)


@pytest.fixture(scope="session")
def served_engine(tiny_dir):
    """The small model in fp32 on CPU behind the async engine, shared by the server tests (context 128)."""
    from glm5next.runtime.async_engine import AsyncLLM

    engine = AsyncLLM.from_args(model=tiny_dir, dtype="float32", device="cpu", max_model_len=128, max_num_seqs=64,
                                seed=0)
    yield engine
    asyncio.run(engine.shutdown())


def pytest_collection_modifyitems(config, items):
    """Tests marked `slow` run first: under the CI's two workers (`.ci/run`) one worker starts the longest
    test at once while the other takes the rest, instead of the longest test starting near the end."""
    items.sort(key=lambda item: item.get_closest_marker("slow") is None)
