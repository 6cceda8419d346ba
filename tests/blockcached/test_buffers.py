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
    b.wait(50, None, first)
    b.wait(10, None, second)   # would fit now, but must not overtake the first waiter
    b.wait(30, None, third)
    assert woken == [] and not b.try_acquire(1)
    b.forget(third)      # its connection closed while waiting
    b.release(60)
    assert woken == [1, 2] and b.used == 60
    b.release(50)
    b.release(10)
    assert b.used == 0 and b.try_acquire(100)


def test_an_owner_holds_at_most_its_share_and_admins_keep_their_reserve():
    b = ByteBudget(100, share=40, reserved=20)
    woken = []
    assert b.try_acquire(40, owner=1)
    assert b.over_share(10, 1) and not b.try_acquire(10, owner=1)
    b.wait(10, 1, lambda: woken.append("uid 1"))
    assert b.try_acquire(30, owner=2)      # uid 1's waiter holds no one else back
    b.wait(20, 3, lambda: woken.append("uid 3"))  # past what owners may hold together
    assert not b.try_acquire(5, owner=4)   # (nor may another owner overtake it)
    assert b.try_acquire(20, owner=None)   # an admin: the reserve is theirs
    assert b.used == 90 and woken == []
    b.release(20)                          # an admin's release lets no owner past its part
    assert woken == []
    b.release(30, owner=2)
    assert woken == ["uid 3"] and b.held == {1: 40, 3: 20}
    b.release(40, owner=1)                 # uid 1's own release lets its waiter in
    assert woken == ["uid 3", "uid 1"] and b.held == {1: 10, 3: 20} and b.owned == 30


def test_a_waiter_for_the_rest_of_the_budget_keeps_its_place():
    b = ByteBudget(100, share=100, reserved=20)
    woken = []
    assert b.try_acquire(70, owner=1) and b.try_acquire(25, owner=None)
    b.wait(20, None, lambda: woken.append("admin"))
    assert not b.try_acquire(5, owner=2)   # would overtake the waiter for the rest
    assert not b.try_acquire(5, owner=None)
    b.release(70, owner=1)
    assert woken == ["admin"] and b.used == 45
