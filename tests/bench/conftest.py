"""One emulated remote with the tiny dataset for the bench smoke tests (module-wide:
uploads once)."""

import pytest

from bench import datasets
from bench.remote import Remote
from bench.systems import Ctx


@pytest.fixture(scope="package")
def bench_ctx(tmp_path_factory):
    work = tmp_path_factory.mktemp("bench")
    size = datasets.SIZES["tiny"]
    with Remote(rtt_ms=1.0, log_path=str(work / "moto.log")) as remote:
        local = str(work / "local")
        datasets.upload(size, remote, local)
        yield Ctx(remote, local, str(work), size)
