"""Radix tree: invariants after every operation on random branching inserts, matches and evictions."""
import random

import pytest

from k3.rollout.radix import RadixTree


class Counter:
    def __init__(self):
        self.pages: dict[int, int] = {}
        self.states: set[int] = set()

    def retain(self, ps):
        for p in ps:
            self.pages[p] = self.pages.get(p, 0) + 1

    def release(self, ps):
        for p in ps:
            self.pages[p] -= 1
            assert self.pages[p] >= 0

    def drop_state(self, s):
        self.states.remove(s)


def test_random_operations_keep_invariants():
    rnd = random.Random(0)
    c = Counter()
    P = 4
    tree = RadixTree(P, c.retain, c.release, c.drop_state)
    seqs = []
    next_page, next_state = 0, 0
    for step in range(300):
        op = rnd.random()
        if op < 0.6 or not seqs:
            base = rnd.choice(seqs) if seqs and rnd.random() < 0.7 else []
            cut = rnd.randint(0, len(base))
            key = base[:cut] + [rnd.randint(0, 3) for _ in range(rnd.randint(1, 9))]
            bt = list(range(next_page, next_page + -(-len(key) // P)))
            next_page += len(bt)
            c.states.add(next_state)
            node = tree.insert("s", key, bt, state=next_state)
            next_state += 1
            assert node.end == len(key) and node.state is not None
            seqs.append(key)
        elif op < 0.85:
            key = rnd.choice(seqs)
            m = tree.match("s", key)
            assert m.hit <= m.prefix <= len(key)
            if m.node is not None:
                assert m.node.state is not None and m.node.end == m.hit
        else:
            node = tree.lru(lambda n: not n.children)
            if node is not None:
                tree.evict_leaf(node)
        tree.check()
        held = {}
        for n in tree.nodes():
            for p in n.pages:
                held[p] = held.get(p, 0) + 1
        assert {p: r for p, r in c.pages.items() if r} == held
        assert c.states == {n.state for n in tree.nodes() if n.state is not None}


def test_match_is_deepest_state_and_split_keeps_pages():
    tree = RadixTree(4)
    tree.insert("s", [1, 2, 3, 4, 5, 6], list(range(2)), state=7)
    m = tree.match("s", [1, 2, 3, 9])
    assert m.node is None and m.prefix == 3
    tree.insert("s", [1, 2, 3], [0], state=8)       # split at 3: upper [0,3) keeps page 0
    m = tree.match("s", [1, 2, 3, 9])
    assert (m.hit, m.prefix, m.node.state) == (3, 3, 8)
    m = tree.match("s", [1, 2, 3, 4, 5, 6, 7])
    assert m.hit == 6
    tree.check()
    assert tree.match("other", [1, 2, 3]).node is None   # scopes never share


def test_drop_scope_releases_everything():
    c = Counter()
    tree = RadixTree(2, c.retain, c.release, c.drop_state)
    c.states |= {1, 2}
    tree.insert((None, 0), [1, 2, 3], [0, 1], state=1)
    tree.insert((None, 0), [1, 2, 4, 5], [0, 2], state=2)
    tree.drop_scope((None, 0))
    assert not c.states and not any(c.pages.values())


def test_insert_rejects_short_block_table():
    with pytest.raises(ValueError, match="block_table"):
        RadixTree(4).insert("s", [1, 2, 3, 4, 5], [0], state=1)
