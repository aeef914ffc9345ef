"""espresso_cupcake's planned runs: their models' plans alone, Espresso with every scheme it may choose calibrated."""

from argparse import Namespace

from experiments import espresso_cupcake


def test_planners_run_their_models_plan_and_espresso_calibrates_every_family():
    args = Namespace(nodes=4, steps=61, overrides="", warmup_steps=6)
    for compressor in ("dgc", "efsignsgd", "randomk"):
        families = espresso_cupcake.other_families(compressor)
        assert espresso_cupcake.scheme_of(compressor) not in families and "gather" in families
        assert ("zen" in families) == (compressor != "efsignsgd")  # zen sums selections: sparsifiers only
        for method in espresso_cupcake.PLANNED:
            out = espresso_cupcake.overrides_of(method, compressor, "1gbit", args)
            assert "sync.trial_steps=0" in out
            calibrated = [o for o in out if o.startswith("sync.calibrate_families=")]
            assert calibrated == ([f"sync.calibrate_families=[{','.join(families)}]"] if method == "espresso" else [])
