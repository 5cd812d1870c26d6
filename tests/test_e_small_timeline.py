"""scripts/e_small_timeline.py: the variant grammar and its shape filters."""


from tests.conftest import ROOT, load_script


def test_knobs_are_the_kernels_keyword_arguments():
    import inspect

    from stages.E_sparse_decode.sm90 import Kernel

    t = load_script("e_small_timeline")
    knobs = t._parse_knobs("fast_combine=0,sink_first=0,pair_stores=1,stamps=1,combine_group=4,splits=9,fmt=simple")
    assert knobs == dict(fast_combine=False, sink_first=False, pair_stores=True, stamps=True, combine_group=4, splits=9,
                         fmt="simple")
    accepted = set(inspect.signature(Kernel.__init__).parameters)
    assert set(knobs) - {"splits", "fmt"} <= accepted  # splits and fmt from the case
    k = Kernel(b=2, config="s2h128_m128bs256_x1024bs64", kv_format="model1", splits="auto",
               **{key: v for key, v in knobs.items() if key not in ("splits", "fmt", "stamps")})
    assert not k.fast_combine and not k.sink_first and k.pair_stores and k.combine_group == 4
    default = Kernel(b=2, config="s2h128_m128bs256_x1024bs64", kv_format="model1", splits="auto")
    # the lab's build options
    assert default.fast_combine and default.sink_first and default.pair_stores and not default.stamps


def test_a_variants_filter_names_its_shapes():
    t = load_script("e_small_timeline")
    assert t._wanted(set(), 3, "s1h64_m96bs64")
    assert t._wanted({"b1", "b2"}, 2, "s2h64_m128bs256_x1024bs64")
    assert not t._wanted({"b1", "b2"}, 8, "s2h64_m128bs256_x1024bs64")
    assert t._wanted({"b16:s2h128"}, 16, "s2h128_m128bs256_x1024bs64")
    assert not t._wanted({"b16:s2h128"}, 16, "s1h128_m128bs256_x1024bs64")



def test_variant_inputs_rotate_as_bench_rotates(monkeypatch):
    """scripts/variant_launch.py: the first set, then clones (timing.rotations)."""
    import sys

    import torch

    sys.path.insert(0, str(ROOT / "scripts"))
    from variant_launch import rotated_sets

    from harness.execution import timing

    monkeypatch.setattr(timing, "l2_bytes", lambda: 50 << 20)  # an H100's L2 (no GPU here)
    first = {"a": torch.arange(1 << 20, dtype=torch.float32), "b": torch.ones(7)}
    sets = rotated_sets(first)
    assert len(sets) == timing.rotations(4 * (1 << 20) + 28, 50 << 20) > 1 and sets[0] is first
    for s in sets[1:]:
        assert all(torch.equal(s[k], first[k]) and s[k].data_ptr() != first[k].data_ptr() for k in first)
