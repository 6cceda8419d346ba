"""The read budget for large frame bodies (`buffers.ByteBudget`), no socket needed."""

from blockcached.buffers import ByteBudget


def test_byte_budget_grants_in_order_and_forgets_the_gone():
    b = ByteBudget(100)
    assert b.try_acquire(60)
    assert not b.try_acquire(50)
    woken = []

    def waiter(n):
        return lambda: woken.append(n)
    first, second, third = waiter(1), waiter(2), waiter(3)
    b.wait(50, first)
    b.wait(10, second)   # would fit now, but must not overtake the first waiter
    b.wait(30, third)
    assert woken == [] and not b.try_acquire(1)
    b.forget(third)      # its connection closed while waiting
    b.release(60)
    assert woken == [1, 2] and b.used == 60
    b.release(50)
    b.release(10)
    assert b.used == 0 and b.try_acquire(100)
