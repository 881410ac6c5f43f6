"""Drafts of a reply's next tokens from the turn's own tokens (speculative decoding, issue 33).

Not typing ahead's draft (exokv.rank.typeahead: the user's unsent line): here a draft is
a guess at the next few tokens of the reply, which the model then checks in one forward
pass (exokv.rank.speculate). The guesses cost no model: prompt-lookup decoding finds
the last earlier place where the turn's tokens (the rendered conversation, then the
reply so far) end as they end now, and proposes what followed there. A reply that
quotes the conversation (code being edited, a paragraph to repeat) is drafted almost
token for token; a free answer is drafted rarely, and `DraftLength` stops drafting
while drafts keep failing, so they cost little.

Pure: no MLX. Every rank holds the same tokens and the same policy state (it changes
only with the accepted counts, which every rank computes alike); rank 0's proposal is
still the one broadcast with the step, so every rank verifies the same draft.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from exokv.cache.radix import Node, RadixTree

MAX_NGRAM = 3  # the longest tail looked up: a longer match is a likelier continuation
MIN_NGRAM = 2  # one token matches too often to predict what follows
MOST = 8  # the longest draft: what one verify pass may run besides its own token
START = 4  # a turn's first draft length
MISSES = 3  # drafts rejected in a row before drafting pauses
FIRST_PAUSE = 4  # tokens decoded plainly after those misses; doubles each time, to
LONGEST_PAUSE = 32  # at most, so a reply that starts quoting late is still drafted
FIRST_RATE = 0.8  # a turn's first guess at a draft token's chance of being kept


class PromptLookup:
    """The turn's tokens with an index of their n-grams: `propose` is a dictionary lookup.

    For each n-gram (n from MIN_NGRAM to MAX_NGRAM) the index keeps the position just
    after its latest occurrence that has a token after it, so the tail the tokens end
    with now is never its own match.
    """

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            end = len(self.tokens)  # `t` follows every n-gram that ends here
            for n in range(MIN_NGRAM, MAX_NGRAM + 1):
                if end >= n:
                    self._after[tuple(self.tokens[end - n : end])] = end
            self.tokens.append(t)

    def propose(self, k: int) -> list[int]:
        """Up to `k` tokens that followed the longest tail of the tokens seen before."""
        if k <= 0:
            return []
        for n in range(MAX_NGRAM, MIN_NGRAM - 1, -1):
            if len(self.tokens) < n:
                continue
            at = self._after.get(tuple(self.tokens[-n:]))
            if at is not None:
                return self.tokens[at : at + k]
        return []


class DraftLength:
    """How many tokens to draft next, from how the last drafts fared.

    A draft accepted whole grows the next one by two (up to MOST); a rejected one sets
    it to what was accepted plus one. MISSES drafts in a row with nothing accepted
    pause drafting for FIRST_PAUSE tokens, then twice as long each time (up to
    LONGEST_PAUSE); an accepted token ends the pauses.
    """

    def __init__(self, most: int = MOST, start: int = START) -> None:
        self.most = most
        self.length = min(start, most)
        self.misses = 0  # drafts rejected whole in a row
        self.pause = 0  # tokens still to decode before the next draft
        self.next_pause = FIRST_PAUSE

    def next(self, room: int) -> int:
        """The next draft's length (0: do not draft now); `room` is the tokens the reply
        may still add, of which the verify pass's own token is one."""
        if self.pause > 0 or room <= 1:
            return 0
        return min(self.length, room - 1)

    def record(self, drafted: int, accepted: int) -> None:
        """A verify pass kept `accepted` of `drafted` tokens."""
        if drafted <= 0:
            return
        if accepted >= drafted:
            self.length = min(self.length + 2, self.most)
        else:
            self.length = max(1, min(self.most, accepted + 1))
        if accepted > 0:
            self.misses, self.next_pause = 0, FIRST_PAUSE
            return
        self.misses += 1
        if self.misses >= MISSES:
            self.pause, self.misses = self.next_pause, 0
            self.next_pause = min(self.next_pause * 2, LONGEST_PAUSE)

    def nothing(self) -> None:
        """A draft step found nothing to draft (or rank 0 found no draft worth its pass):
        a short pause, so that on several ranks a reply with nothing to draft pays a
        step's collective only every few tokens, as plain decoding's stop check."""
        self.pause = max(self.pause, FIRST_PAUSE)

    def decoded(self, tokens: int) -> None:
        """`tokens` more of the reply were decoded (a pause runs out with them)."""
        self.pause = max(0, self.pause - tokens)


class TreeContinuation:
    """What the prefix tree stored after the turn's tokens so far: a reply given before
    to the same context (after /retry, a resent conversation, another session's turn).

    A cursor at the tokens' end in the tree, moved on with each decoded token (the tree
    does not change during a turn's decode); off the tree, it proposes nothing. Where
    the stored path branches, the branch used last is followed.
    """

    def __init__(self, tree: RadixTree, tokens: Sequence[int]) -> None:
        found = tree.match(tokens)
        self.node: Node | None = None
        self.at = 0  # tokens of self.node's edge the cursor is past
        if found.length == len(tokens) and found.last is not None:
            self.node, self.at = found.last, len(tokens) - found.last.start

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            node = self.node
            if node is None:
                return
            if self.at < len(node.key):
                if node.key[self.at] == t:
                    self.at += 1
                else:
                    self.node = None
            else:
                child = node.children.get(t)
                self.node, self.at = (child, 1) if child is not None else (None, 0)

    def propose(self, k: int) -> list[int]:
        node = self.node
        if node is None or k <= 0:
            return []
        out = list(node.key[self.at : self.at + k])
        while len(out) < k and node.children:
            node = max(node.children.values(), key=lambda c: c.last_used)
            out += node.key[: k - len(out)]
        return out


class PassCost:
    """What a verify pass costs on this machine, as rank 0 measured it, and so how long a
    draft is worth its pass.

    A pass of 1 + j tokens takes about `one + extra * j` seconds: on a GPU `extra` is
    small (a few tokens cost about one's weights read), on a busy CPU nearly `one` (the
    products are compute-bound). With each draft token kept with probability `rate`,
    a pass with j draft tokens yields 1 + rate + ... + rate^j tokens; `worth` is the
    j up to k with the most tokens per second, 0 where drafting loses to plain steps.
    Only rank 0's proposal is cut by it (the draft is carried to the others), so the
    ranks' different clocks never split their decisions.
    """

    WEIGHT = 0.3  # of a new measurement in the running estimates

    def __init__(self) -> None:
        self.one: float | None = None  # seconds of a one-token pass
        self.extra: float | None = None  # seconds each draft token adds to a pass

    def took(self, tokens: int, seconds: float) -> None:
        if tokens <= 1:
            self.one = _blend(self.one, seconds, self.WEIGHT)
        elif self.one is not None:
            self.extra = _blend(
                self.extra, max(0.0, seconds - self.one) / (tokens - 1), self.WEIGHT
            )

    def worth(self, k: int, rate: float, drafting: float = 0.0) -> int:
        """`drafting`: the seconds each draft token costs to propose (a draft model's
        forward pass; 0 for the conversation's drafts), added to its cost in the pass."""
        if self.one is None or self.extra is None or k <= 0:
            return k  # not measured yet: draft, which measures it
        best, best_speed, tokens = 0, 1.0 / self.one, 1.0
        for j in range(1, k + 1):
            tokens += rate**j
            speed = tokens / (self.one + (self.extra + drafting) * j)
            if speed > best_speed:
                best, best_speed = j, speed
        return best


def _blend(old: float | None, new: float, weight: float) -> float:
    return new if old is None else (1 - weight) * old + weight * new


class ModelSource(Protocol):
    """A draft model (exokv.rank.draft_model, rank 0 only): greedy guesses after `tokens`."""

    seconds: float | None  # what one draft token costs to propose, as measured; None: not yet

    def propose(self, tokens: Sequence[int], k: int) -> list[int]: ...


CONVERSATION, MODEL = "conversation", "model"  # where a draft came from


class Drafter:
    """The turn's draft sources and the length policy, together: what decode asks.

    The prefix tree's stored continuation comes first (a whole earlier reply to this
    very context), then prompt lookup in the turn's own tokens, and where both give
    nothing, the draft model (--draft-model), if there is one. Each source has its
    own acceptance rate, and the model's drafts also their own cost, in what `cost`
    decides a draft is worth."""

    def __init__(
        self,
        tokens: Sequence[int],
        most: int = MOST,
        tree: RadixTree | None = None,
        cost: PassCost | None = None,
        model: ModelSource | None = None,
    ) -> None:
        self.lookup = PromptLookup(tokens)
        self.tree = TreeContinuation(tree, tokens) if tree is not None else None
        self.length = DraftLength(most)
        self.cost = cost
        self.model = model
        self.rate = FIRST_RATE  # a draft token's chance of being kept, as this turn's went
        self.model_rate = FIRST_RATE  # the same for the draft model's drafts
        self.source = ""  # where rank 0's last draft came from (CONVERSATION or MODEL)
        self.model_drafted = 0  # of the turn's draft tokens, the draft model's (rank 0)

    def size(self, room: int) -> int:
        return self.length.next(room)

    def plain_after(self, asked: int, room: int) -> bool:
        """Whether the step after a plain one (one token; `asked`: the draft it asked
        for, which came empty) is plain too, before that token is known: so its
        forward pass can start at once. Every rank answers alike."""
        if asked:
            return True  # nothing to draft: a pause (DraftLength.nothing)
        return self.length.pause > 1 or room <= 2

    def propose(self, k: int) -> list[int]:
        """Rank 0's draft of at most `k` tokens (fewer where a longer one is not worth
        its pass, by `cost`)."""
        self.source = ""
        free = self.cost.worth(k, self.rate) if self.cost is not None else k
        if free > 0:
            stored = self.tree.propose(free) if self.tree is not None else []
            found = stored or self.lookup.propose(free)
            if found:
                self.source = CONVERSATION
                return found
        if self.model is None:
            return []
        if self.cost is not None:
            if self.cost.one is None:
                # A plain pass first: the model's drafts are weighed against its time,
                # which only plain steps measure (and a model that always drafts would
                # never leave one).
                return []
            k = self.cost.worth(k, self.model_rate, self.model.seconds or 0.0)
        if k <= 0:
            return []
        self.source = MODEL
        drafted = self.model.propose(self.lookup.tokens, k)
        self.model_drafted += len(drafted)
        return drafted

    def advance(self, drafted: int, accepted: int, new: Sequence[int], asked: int = 0) -> None:
        """A step's outcome: `drafted` proposed (of `asked`, 0 on a plain step),
        `accepted` kept, `new` tokens decoded."""
        if drafted:
            if self.source == MODEL:
                self.model_rate = _blend(self.model_rate, accepted / drafted, PassCost.WEIGHT)
            else:
                self.rate = _blend(self.rate, accepted / drafted, PassCost.WEIGHT)
        self.source = ""
        self.length.record(drafted, accepted)
        self.length.decoded(len(new))
        if asked and not drafted:
            self.length.nothing()  # after this step's tokens: the next ones are plain
        self.lookup.extend(new)
        if self.tree is not None:
            self.tree.extend(new)


class ScriptedDrafter(Drafter):
    """Tests only (EXOKV_TEST_DRAFTS): drafts a reply from a given token list, what
    follows the reply's length in it, with every third of its tokens made wrong, so
    a verify pass meets right and wrong tokens on models that never repeat text."""

    def __init__(self, tokens: Sequence[int], script: Sequence[int], most: int = MOST) -> None:
        super().__init__(tokens, most)
        self.prompt = len(tokens)
        self.script = list(script)

    def propose(self, k: int) -> list[int]:
        at = len(self.lookup.tokens) - self.prompt
        return [t + 1 if (at + i) % 3 == 2 else t for i, t in enumerate(self.script[at : at + k])]
