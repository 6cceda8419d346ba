"""The committed gRPC stubs are what `make proto` makes from the .proto files today."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest

from tests.support.fsclient_mounts import REPO

PROTOS = [os.path.join("blockcache_csi", "proto", f"{n}.proto") for n in ("csi", "registration")]
STUBS = ("csi_pb2.py", "csi_pb2_grpc.py", "registration_pb2.py", "registration_pb2_grpc.py")


def test_committed_stubs_match_the_proto(tmp_path):
    pytest.importorskip("grpc_tools", reason="grpcio-tools is the `proto` extra")
    os.makedirs(tmp_path / "blockcache_csi" / "proto")
    for proto in PROTOS:
        shutil.copy(os.path.join(REPO, proto), tmp_path / proto)
    subprocess.run([sys.executable, "-m", "grpc_tools.protoc", "-I.", "--python_out=.",
                    "--grpc_python_out=.", *PROTOS], cwd=tmp_path, check=True, timeout=60)
    for name in STUBS:
        made = (tmp_path / "blockcache_csi" / "proto" / name).read_bytes()
        with open(os.path.join(REPO, "blockcache_csi", "proto", name), "rb") as f:
            assert f.read() == made, f"{name} is stale: run `make proto` and commit it"
