"""espresso_cupcake's planned runs: their models' plans alone, Espresso with every scheme it may choose calibrated."""

from argparse import Namespace

from experiments import espresso_cupcake


def test_planners_run_their_models_plan_and_espresso_calibrates_every_family():
    args = Namespace(nodes=4, steps=espresso_cupcake.DEFAULT_STEPS, overrides="", warmup_steps=6)
    for compressor in ("dgc", "efsignsgd", "randomk"):
        families = espresso_cupcake.other_families(compressor)
        assert espresso_cupcake.scheme_of(compressor) not in families and "gather" in families
        assert ("zen" in families) == (compressor != "efsignsgd")  # zen sums selections: sparsifiers only
        for method in espresso_cupcake.PLANNED:
            out = espresso_cupcake.overrides_of(method, compressor, "1gbit", args)
            assert "sync.trial_steps=0" in out
            calibrated = [o for o in out if o.startswith("sync.calibrate_families=")]
            assert calibrated == ([f"sync.calibrate_families=[{','.join(families)}]"] if method == "espresso" else [])
            assert "sync.calibrate_fused=true" in out  # both planners: per group and per element apart
            assert ("sync.calibrate_mixed=true" in out) == (method == "espresso")  # Espresso's alone
    # Every method's measured window starts after the longest calibration: profiled steps, each family
    # layer-wise and fused, the mixed step, and the first planned step.
    family = espresso_cupcake.SETTLE_STEPS + espresso_cupcake.CALIBRATE_STEPS
    longest = espresso_cupcake.PROFILE_STEPS + (2 * (1 + max(len(espresso_cupcake.other_families(c))
                                                             for c in ("dgc", "efsignsgd", "randomk"))) + 1) * family + 1
    assert espresso_cupcake.AFTER_WARMUP >= longest
    assert espresso_cupcake.DEFAULT_STEPS >= args.warmup_steps + espresso_cupcake.AFTER_WARMUP + 3
