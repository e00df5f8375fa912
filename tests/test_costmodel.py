"""The alpha-beta cost model of the allreduce algorithms (dpbook.costmodel): framework-free,
so these tests need neither torch nor jax."""
from __future__ import annotations

import pytest

from dpbook import costmodel


def test_coefficients_of_the_three_algorithms():
    assert costmodel.coefficients("naive", 4) == (6, 6)
    assert costmodel.coefficients("ring", 4) == (6, 1.5)
    assert costmodel.coefficients("tree", 4) == (4, 4)
    assert costmodel.coefficients("tree", 5) == (6, 6)       # ceil(log2 5) = 3
    with pytest.raises(ValueError, match="unknown algorithm"):
        costmodel.coefficients("butterfly", 4)


def test_fit_recovers_alpha_and_beta():
    alpha, beta = 50e-6, 1 / 2e9
    data = [{"algorithm": a, "processes": n, "bytes": b,
             "seconds": costmodel.predict(a, b, n, alpha, beta)}
            for a in costmodel.ALGORITHMS for n in (2, 3, 4) for b in (1e3, 1e5, 1e7)]
    fitted = costmodel.fit(data)
    assert fitted == pytest.approx((alpha, beta), rel=1e-6)


def test_bus_bandwidth_of_a_ring_does_not_depend_on_n():
    beta = 1 / 10e9
    for n in (2, 4, 8):
        t = costmodel.predict("ring", 1e8, n, 0.0, beta)
        assert costmodel.bus_bandwidth(1e8, t, n) == pytest.approx(10e9)


def test_on_a_shared_medium_every_algorithm_moves_the_same_bytes():
    for n in (2, 3, 4, 8):
        totals = {costmodel.coefficients(a, n, links="shared")[1] for a in costmodel.ALGORITHMS}
        assert totals == {2 * (n - 1)}
    # ... which is what the ring's processes send together on separate links
    assert costmodel.coefficients("ring", 4)[1] * 4 == 2 * 3
    with pytest.raises(ValueError, match="links must be"):
        costmodel.coefficients("ring", 4, links="wireless")


def test_relative_error_is_zero_for_the_model_itself():
    data = [{"algorithm": "tree", "processes": 4, "bytes": b,
             "seconds": costmodel.predict("tree", b, 4, 1e-4, 1e-9, "shared")}
            for b in (1e3, 1e6)]
    assert costmodel.relative_error(data, 1e-4, 1e-9, "shared") == pytest.approx(0, abs=1e-12)
    assert costmodel.fit(data, "shared") == pytest.approx((1e-4, 1e-9), rel=1e-6)



def test_every_link_has_a_typical_latency_in_a_plausible_order():
    """The calculator's presets take α from LINK_LATENCY and β from LINKS: one latency per
    link, microseconds to tens of microseconds, NVLink below PCIe below the networks, and
    RDMA (InfiniBand) below TCP over Ethernet."""
    lat = costmodel.LINK_LATENCY
    assert set(lat) == set(costmodel.LINKS)
    assert all(isinstance(v, float) and 1e-7 < v < 1e-3 for v in lat.values()), lat
    nvlink = [v for k, v in lat.items() if k.startswith("NVLink")]
    pcie = [v for k, v in lat.items() if k.startswith("PCIe")]
    ethernet = [v for k, v in lat.items() if k.startswith("Ethernet")]
    infiniband = [v for k, v in lat.items() if k.startswith("InfiniBand")]
    assert nvlink and pcie and ethernet and infiniband
    assert max(nvlink) < min(pcie) <= max(pcie) <= min(infiniband)
    assert max(infiniband) < min(ethernet)
    # with these, the ring overtakes the tree on 8 GPUs below a few MB, not at 80 MB
    L_ring, B_ring = costmodel.coefficients("ring", 8)
    L_tree, B_tree = costmodel.coefficients("tree", 8)
    name = "NVLink (H100, 18 links)"
    crossover = ((L_ring - L_tree) * lat[name]
                 / ((B_tree - B_ring) / costmodel.LINKS[name]))
    assert 1e5 < crossover < 1e7


def test_break_even_batch_is_allreduce_time_over_backward_time_per_example():
    # by hand: ring of 4, 1 MB, α = 10 µs, 1 GB/s, 1 ms of backward per example:
    # T = 2·3·10e-6 + 2·3/4·1e6/1e9 = 60e-6 + 1.5e-3 = 1.56e-3 s, so b* = 1.56
    b = costmodel.break_even_batch(1e6, 4, 10e-6, 1e-9, 1e-3)
    assert b == pytest.approx(1.56)
    assert costmodel.break_even_batch(1e6, 4, 10e-6, 1e-9, 1e-3, algorithm="naive") \
        == pytest.approx((6 * 10e-6 + 6 * 1e6 * 1e-9) / 1e-3)
    # more bytes: a larger batch is needed; more compute per example: a smaller one
    assert costmodel.break_even_batch(1e8, 4, 10e-6, 1e-9, 1e-3) > b
    assert costmodel.break_even_batch(1e6, 4, 10e-6, 1e-9, 1e-2) < b
    with pytest.raises(ValueError, match="must be positive"):
        costmodel.break_even_batch(1e6, 4, 10e-6, 1e-9, 0.0)


def test_communication_share_falls_with_the_batch_and_hides_with_overlap():
    # 1 ms of allreduce, 0.1 ms of compute per example, no fixed cost, no overlap:
    # at a batch of 10 the step computes 1 ms and waits 1 ms: a half
    assert costmodel.communication_share(10, 1e-3, 1e-4) == pytest.approx(0.5)
    assert costmodel.communication_share(1, 1e-3, 1e-4) > costmodel.communication_share(
        100, 1e-3, 1e-4)
    # a fixed cost per step lowers the share
    assert costmodel.communication_share(10, 1e-3, 1e-4, fixed_seconds=1e-3) == \
        pytest.approx(1 / 3)
    # with the backward pass (here 2/3 of the compute) hiding it: nothing exposed from
    # break_even_batch on, which is where the backward pass lasts as long as the allreduce
    back = 1e-4 * 2 / 3
    b_star = 1e-3 / back
    assert costmodel.communication_share(b_star, 1e-3, 1e-4, hidden_per_example=back) == 0
    assert costmodel.communication_share(b_star / 2, 1e-3, 1e-4,
                                         hidden_per_example=back) > 0
    with pytest.raises(ValueError, match="positive"):
        costmodel.communication_share(0, 1e-3, 1e-4)
