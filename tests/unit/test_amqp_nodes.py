"""Which node of a RabbitMQ cluster the drain tries first (drain_adapters.amqp.nodes), with a
manual clock: the nodes share one connect timeout, a failed node is tried last next time."""

from __future__ import annotations

from drain_adapters.amqp import nodes as amqp_nodes

from tests.conftest import ManualClock


def tried(
    rotation: amqp_nodes.NodeRotation, outcomes: dict[int, float | None], clock: ManualClock
) -> list[int]:
    """Run one open: each node takes ``outcomes[index]`` seconds and fails, or connects (None)."""
    order = []
    for index, _left in rotation.attempts(10.0):
        order.append(index)
        cost = outcomes.get(index)
        if cost is None:
            rotation.connected(index)
            break
        clock.advance(cost)
        rotation.failed(index)
    return order


def test_nodes_are_tried_in_order_and_a_good_node_is_kept() -> None:
    clock = ManualClock()
    rotation = amqp_nodes.NodeRotation(3, clock)
    assert tried(rotation, {0: 0.01}, clock) == [0, 1]  # node 1 refuses at once: node 2 connects
    rotation.closed()  # closed on purpose (idle): the same node again
    assert tried(rotation, {}, clock) == [1]
    rotation.lost()  # node 2 died under the connection: it is tried last
    assert tried(rotation, {0: 0.01}, clock) == [2]


def test_the_nodes_share_one_connect_timeout() -> None:
    """A silent node eats the timeout once; the next open starts with the node after it."""
    clock = ManualClock()
    rotation = amqp_nodes.NodeRotation(3, clock)
    assert tried(rotation, {0: 10.0, 1: 0.01}, clock) == [0]  # the budget is spent on node 1
    assert rotation.start == 1
    assert tried(rotation, {0: 10.0, 1: 0.01}, clock) == [1, 2]


def test_every_node_down_cycles_through_all_of_them() -> None:
    clock = ManualClock()
    rotation = amqp_nodes.NodeRotation(3, clock)
    down = {0: 0.01, 1: 0.01, 2: 0.01}
    assert tried(rotation, down, clock) == [0, 1, 2]
    assert tried(rotation, down, clock) == [0, 1, 2]
    single = amqp_nodes.NodeRotation(1, clock)
    assert tried(single, {0: 20.0}, clock) == [0]
    assert tried(single, {}, clock) == [0]
