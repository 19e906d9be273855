"""The lane simulation against step times worked out by hand, and the window search against brute force."""

import random
from dataclasses import replace

import pytest

from pystronghold.planner.cost import BlockCosts
from pystronghold.planner.timeline import choose_window, simulate_step


def costs(fwd=1.0, bwd=2.0, load=0.0, grad=0.0, adam=0.0, allreduce=0.0, tail=0.0) -> BlockCosts:
    return BlockCosts(block_params=1, block_numel=16, slot_bytes=1, head_tail_bytes=0, block_input_bytes=0,
                      block_activation_bytes=0, tail_activation_bytes=0, fwd_s=fwd, bwd_s=bwd,
                      head_tail_s=tail, load_s=load, grad_s=grad, allreduce_s=allreduce, adam_s=adam)


def test_free_transfers_cost_only_compute():
    st = simulate_step(costs(fwd=1.0, bwd=2.0, tail=0.5), n_blocks=5, window=2)
    assert st.total_s == pytest.approx(15.5)
    assert st.compute_s == pytest.approx(15.5)
    assert st.exposed_transfer_s == pytest.approx(0.0)
    assert st.exposed_optimizer_s == pytest.approx(0.0)


def test_window_of_one_exposes_every_load():
    # 3 forward loads and 2 backward reloads (block 2 stays for backward), each 0.5 s, nothing hides
    st = simulate_step(costs(load=0.5), n_blocks=3, window=1)
    assert st.total_s == pytest.approx(9.0 + 5 * 0.5)
    assert st.exposed_transfer_s == pytest.approx(2.5)


def test_window_of_two_hides_all_but_the_first_load():
    st = simulate_step(costs(load=0.5), n_blocks=3, window=2)
    assert st.total_s == pytest.approx(9.5)
    assert st.exposed_transfer_s == pytest.approx(0.5)


def test_slow_host_updates_delay_the_next_forward():
    # W = 3: no reloads. Adam 3 s per block after each backward: block 0's update ends 5 s after the
    # backward does (worked out by hand: 14 s per step in steady state).
    st = simulate_step(costs(adam=3.0), n_blocks=3, window=3)
    assert st.total_s == pytest.approx(14.0)
    assert st.exposed_optimizer_s == pytest.approx(5.0)
    assert st.exposed_transfer_s == pytest.approx(0.0)


def test_forward_overlap_waits_for_the_whole_gradient():
    back = simulate_step(costs(adam=1.5, grad=0.1), n_blocks=4, window=4, overlap="backward")
    fwd = simulate_step(costs(adam=1.5, grad=0.1), n_blocks=4, window=4, overlap="forward")
    assert fwd.total_s > back.total_s


def test_forward_overlap_updates_start_after_the_resident_blocks_backward():
    # K=2 resident + 2 streamed (W=2), fwd 1, bwd 2, host Adam 3 per streamed block, clipping. The
    # norm needs the resident blocks' gradients too, so the updates start when the whole backward
    # has ended (as step() submits them), not after the last streamed copy-out: block 2's update
    # ends 3 s into the next step, block 3's 6 s; forward: residents to 2, block 2 from 3 to 4,
    # block 3 from 6 to 7; backward 8: 15 s per step (by hand; 12 if they started 4 s earlier).
    st = simulate_step(costs(adam=3.0), n_blocks=4, window=2, overlap="forward", resident=2)
    assert st.total_s == pytest.approx(15.0)
    assert st.exposed_optimizer_s == pytest.approx(3.0)


def test_gradient_copies_hold_slots_in_backward():
    fast = simulate_step(costs(load=0.1, grad=0.1), n_blocks=6, window=2)
    slow = simulate_step(costs(load=0.1, grad=1.5), n_blocks=6, window=2)
    assert slow.exposed_transfer_s > fast.exposed_transfer_s


def _random_costs(rng: random.Random) -> BlockCosts:
    return costs(fwd=rng.uniform(0.1, 1), bwd=rng.uniform(0.2, 3), load=rng.uniform(0, 2),
                 grad=rng.uniform(0, 2), adam=rng.uniform(0, 2), allreduce=rng.uniform(0, 0.5),
                 tail=rng.uniform(0, 1))


def test_step_time_never_grows_with_the_window():
    rng = random.Random(1)
    for _ in range(40):
        c, n = _random_costs(rng), rng.randint(1, 12)
        times = [simulate_step(c, n, w).total_s for w in range(1, n + 1)]
        assert all(b <= a + 1e-9 for a, b in zip(times, times[1:])), times
        no_opt = [simulate_step(replace(c, adam_s=0.0), n, w).total_s for w in range(1, n + 1)]
        assert all(b <= a + 1e-9 for a, b in zip(no_opt, no_opt[1:])), no_opt


def test_choose_window_is_the_brute_force_answer():
    rng = random.Random(2)
    for _ in range(40):
        c, n = _random_costs(rng), rng.randint(1, 12)
        max_w = rng.randint(1, n)
        steps = {w: simulate_step(c, n, w) for w in range(1, max_w + 1)}
        times = {w: st.total_s for w, st in steps.items()}
        no_opt = {w: st.compute_s + st.exposed_transfer_s for w, st in steps.items()}
        expected = min(w for w in steps if times[w] <= min(times.values()) * 1.01
                       and no_opt[w] <= min(no_opt.values()) * 1.01)
        w, st = choose_window(c, n, max_w)
        assert w == expected
        assert st.total_s == pytest.approx(times[w])


def test_a_slow_optimizer_does_not_shrink_the_window():
    # the host updates dominate, so every W has the same step time; W must still hide the loads
    c = costs(fwd=1.0, bwd=2.0, load=1.5, grad=0.5, adam=10.0)
    w, st = choose_window(c, 8, 8)
    assert w > 1
    assert st.exposed_transfer_s <= simulate_step(replace(c, adam_s=0.0), 8, 8).exposed_transfer_s * 1.01 + 1e-9


def test_window_below_one_is_refused():
    with pytest.raises(ValueError, match="window"):
        simulate_step(costs(), 3, 0)
    with pytest.raises(ValueError, match="max_window"):
        choose_window(costs(), 3, 0)


def test_three_steps_reach_the_steady_state():
    from pystronghold.planner.timeline import _run

    rng = random.Random(5)
    for _ in range(60):
        c, n = _random_costs(rng), rng.randint(1, 15)
        w = rng.randint(1, n)
        for overlap in ("backward", "forward"):
            assert _run(c, n, w, overlap, 3) == pytest.approx(_run(c, n, w, overlap, 8), rel=1e-9)
