"""parallel.collectives: the choices, the environment each needs (NVLink multicast never turned on), the
refusals on gloo / CPU, and FSDP2's symmetric-memory switch on every unit."""

from __future__ import annotations

import pytest
import torch

from gemray.config import load_config
from gemray.parallel.collectives import (apply_collectives_env, check_collectives, collectives_env,
                                         configure_fsdp_units)


def test_env_per_choice():
    assert collectives_env("nccl") == {}
    assert collectives_env("symmetric_memory") == {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    assert collectives_env("copy_engine") == {"NCCL_CTA_POLICY": "2", "NCCL_NVLS_ENABLE": "0",
                                              "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    env = {"NCCL_CTA_POLICY": "1"}  # an explicit setting wins
    assert apply_collectives_env("copy_engine", env) == {"NCCL_NVLS_ENABLE": "0",
                                                          "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1"}
    assert env["NCCL_CTA_POLICY"] == "1"
    assert apply_collectives_env("nccl", {}) == {}


def test_refused_without_nccl():
    check_collectives("copy_engine", "nccl")
    check_collectives("nccl", "gloo")
    for choice in ("copy_engine", "symmetric_memory"):
        with pytest.raises(ValueError, match=f"parallel.collectives='{choice}' needs NCCL"):
            check_collectives(choice, "gloo")
        with pytest.raises(ValueError, match="ray.use_gpu=true"):
            load_config(None, [f"parallel.collectives={choice}"])
        assert load_config(None, [f"parallel.collectives={choice}", "ray.use_gpu=true"]).parallel.collectives == choice
    with pytest.raises(ValueError, match="parallel.collectives"):
        load_config(None, ["parallel.collectives=nvls"])


def test_fsdp_units_get_symmetric_memory_buffers():
    calls = []

    class Unit(torch.nn.Module):
        def set_symm_mem_for_comm(self, backend):
            calls.append(backend)

    assert configure_fsdp_units([Unit(), Unit()], "nccl") == 0 and calls == []
    assert configure_fsdp_units([Unit(), Unit()], "copy_engine") == 2 and calls == ["NCCL", "NCCL"]
    with pytest.raises(ValueError, match="set_symm_mem_for_comm"):
        configure_fsdp_units([torch.nn.Linear(1, 1)], "symmetric_memory")
