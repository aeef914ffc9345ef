"""Random profiles: instances for the optimality tests and the planning-time experiment.

Sizes are log-uniform (a model has many small tensors and a few large ones), ready times grow with
the sizes already produced, compression costs are constant-then-linear with random coefficients,
and the cluster is drawn from 2-16 workers, 1-4 ranks per machine, 100 Mbit/s - 100 Gbit/s;
fusing costs up to 50 us per member and 0.2 ns per element; in half the profiles the slowest rank
ends backward up to 3 ms behind.
"""

from __future__ import annotations

import random
from dataclasses import replace

from ddlscale.plan.fit import CostFit
from ddlscale.plan.profile import CompressorProfile, Profile, TensorProfile

# (name, constructor params, fixed_size): summable and not, sparse and quantizing.
COMPRESSORS = (("topk", {"ratio": 0.01}), ("randomk", {"ratio": 0.05}), ("fp16", {}), ("signsgd", {}),
               ("dgc", {"ratio": 0.01}))


def _fit(rng: random.Random, floor: tuple[float, float], per_element: tuple[float, float]) -> CostFit:
    return CostFit(rng.uniform(*floor), 0.0, rng.uniform(*per_element))


def random_profile(rng: random.Random, count: int, world_size: int | None = None,
                   min_exp: float = 6, max_exp: float = 22) -> Profile:
    """A random but plausible profile of ``count`` tensors (see the module doc)."""
    tensors, ready = [], 0.0
    compute_per_element = rng.uniform(1e-10, 5e-9)
    for i in range(count):
        numel = int(2 ** rng.uniform(min_exp, max_exp))
        ready += rng.uniform(0, 5e-4) + numel * compute_per_element
        kept = {"default": rng.uniform(0.005, 0.02)}
        tensors.append(TensorProfile(f"layer{i}.weight", numel, (numel,), "torch.float32", ready, kept))
    name, params = rng.choice(COMPRESSORS)
    encode = _fit(rng, (1e-5, 2e-4), (1e-10, 2e-8))
    decode = _fit(rng, (1e-5, 1e-4), (1e-10, 1e-8))
    slower = rng.uniform(1.0, 4.0)  # the side device (a CPU beside the GPU) is slower per element
    side_encode = CostFit(encode.floor_s * 2, 0.0, encode.per_element_s * slower)
    side_decode = CostFit(decode.floor_s * 2, 0.0, decode.per_element_s * slower)
    zero = CostFit()
    compressors = {"none": CompressorProfile("none", {}, zero, zero, zero, zero),
                   "default": CompressorProfile(name, dict(params), encode, decode, side_encode, side_decode, 40)}
    network = {"bandwidth": rng.choice(["100mbit", "1gbit", "10gbit", "100gbit"]),
               "latency": rng.choice(["5us", "50us", "200us"]), "gpus_per_machine": rng.choice([1, 2, 4])}
    backward_end, rest = ready + rng.uniform(0, 2e-3), rng.uniform(0, 1e-2)
    world = world_size or rng.choice([2, 4, 8, 16])
    # Per fused member (charged where the compressor scales per member), then a slowest rank behind, or none.
    member_encode, member_decode = rng.uniform(0, 5e-5), rng.uniform(0, 2e-5)
    lag = rng.choice([0.0, rng.uniform(0, 3e-3)])
    compressors["default"] = replace(compressors["default"], member_encode_s=member_encode,
                                     member_decode_s=member_decode,
                                     fused_encode_per_element_s=rng.uniform(0, 2e-10),
                                     fused_decode_per_element_s=rng.uniform(0, 2e-10))
    return Profile(tensors, backward_end, rest, world, network, compressors, lag_s=lag)
