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

from collections import Counter, deque
from collections.abc import Sequence
from typing import Any, Protocol

from exokv.cache.radix import Node, RadixTree
from exokv.rank.costline import line

MAX_NGRAM = 3  # the longest tail looked up: a longer match is a likelier continuation
MIN_NGRAM = 2  # one token matches too often to predict what follows
MOST = 8  # the longest draft: what one verify pass may run besides its own token
# The draft length while the pass cost is not known (no draft step timed and no prefill
# to read): one token, so a first draft that fails costs a two-token pass (on 4-bit
# weights here 2.2 plain steps, where a draft of 4 cost 4.6), while the two sizes timed
# already draw the line that finds long passes cheap where they are.
START = 1
MISSES = 3  # drafts rejected in a row before drafting pauses
FIRST_PAUSE = 4  # tokens decoded plainly after those misses; doubles each time, to
LONGEST_PAUSE = 32  # at most, so a reply that starts quoting late is still drafted
FIRST_RATE = 0.8  # a turn's first guess at a draft token's chance of being kept
PRIOR = 5.0  # ...held as if from this many draft tokens' outcomes
FORGET = 0.8  # of the outcomes so far, what each new draft's leaves (recent ones count most)
PROBE_EVERY = 8  # rank 0's draft decisions between two probes of the longest draft
PROBE_RATE = 0.5  # a source kept less often than this is not worth a probe


class PromptLookup:
    """The turn's tokens with an index of their n-grams: `propose` is a dictionary lookup.

    For each n-gram (n from MIN_NGRAM to MAX_NGRAM) the index keeps the position just
    after its latest occurrence that has a token after it, so the tail the tokens end
    with now is never its own match.
    """

    def __init__(self, tokens: Sequence[int] = ()) -> None:
        self.tokens: list[int] = []
        self._after: dict[tuple[int, ...], int] = {}
        self._heads: set[tuple[int, ...]] = set()  # the indexed MIN_NGRAM-grams but their last
        self.extend(tokens)

    def extend(self, tokens: Sequence[int]) -> None:
        for t in tokens:
            end = len(self.tokens)  # `t` follows every n-gram that ends here
            for n in range(MIN_NGRAM, MAX_NGRAM + 1):
                if end >= n:
                    self._after[tuple(self.tokens[end - n : end])] = end
            if end >= MIN_NGRAM:
                self._heads.add(tuple(self.tokens[end - MIN_NGRAM : end - 1]))
            self.tokens.append(t)

    def may_find_after_next(self) -> bool:
        """Whether `propose` could find anything once one more token, not known yet,
        is added: only if some indexed MIN_NGRAM-gram begins as the tail then looked
        up will (a longer tail matches only where its shorter end does). False: it
        surely finds nothing, so the step after that token can be computed ahead."""
        if len(self.tokens) < MIN_NGRAM - 1:
            return False
        head = tuple(self.tokens[len(self.tokens) - (MIN_NGRAM - 1) :])
        # The next token indexes the n-gram ending with the last one, too.
        return head in self._heads or tuple(self.tokens[-MIN_NGRAM:-1]) == head

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
    """When to draft, and at most how much: what every rank knows alike.

    The length itself is rank 0's choice (`PassCost.worth` in `Drafter.propose`, what a
    pass of that length is expected to yield per second); this is its cap, MOST and
    the reply's room. MISSES drafts in a row with nothing accepted pause drafting for
    FIRST_PAUSE tokens, then twice as long each time (up to LONGEST_PAUSE); an
    accepted token ends the pauses. A draft step that came back empty pauses for what
    rank 0 asked with it (`pause_for`).
    """

    def __init__(self, most: int = MOST) -> None:
        self.most = most  # the cap while drafting
        self.misses = 0  # drafts rejected whole in a row
        self.pause = 0  # tokens still to decode before the next draft
        self.next_pause = FIRST_PAUSE

    def next(self, room: int) -> int:
        """The next draft's cap (0: do not draft now); `room` is the tokens the reply
        may still add, of which the verify pass's own token is one."""
        if self.pause > 0 or room <= 1:
            return 0
        return min(self.most, room - 1)

    def record(self, drafted: int, accepted: int) -> None:
        """A verify pass kept `accepted` of `drafted` tokens."""
        if drafted <= 0:
            return
        if accepted > 0:
            self.misses, self.next_pause = 0, FIRST_PAUSE
            return
        self.misses += 1
        if self.misses >= MISSES:
            self.pause, self.misses = self.next_pause, 0
            self.next_pause = min(self.next_pause * 2, LONGEST_PAUSE)

    def pause_for(self, tokens: int) -> None:
        """Decode `tokens` plainly before the next draft step (at least)."""
        self.pause = max(self.pause, tokens)

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
    """What a step of 1 + j tokens (the last token and j draft tokens) costs here, learnt
    on the fly, and so how long a draft is worth its pass.

    Rank 0 times each decode step whole, from its start to its tokens (on pipeline
    ranks that includes every rank's layers and the hops; a plain step computed ahead
    overlaps the one before, as plain decoding does), and keeps the last WINDOW times
    of each size. Every size is estimated by one line, cost = a + b * tokens, through
    the second fastest of each size's times (what ignores the steps a busy machine
    slowed; the line pools the sizes, so one size's bad luck moves it little
    and sizes never tried are read off it). On a GPU, or a CPU with
    float16 weights, extra tokens cost little (a pass reads the weights once); with
    4-bit weights on this CPU each costs about as much as the first.

    `worth` chooses the draft length with the most expected tokens per second: a
    draft of j tokens each kept with probability `rate` (given the ones before it)
    yields 1 + rate + ... + rate^j tokens for cost(1 + j); 0 unless that beats a plain
    step by MARGIN. Only rank 0's proposal is cut by it (the draft is carried to the
    others), so the ranks' different clocks never split their decisions.
    """

    WINDOW = 11  # the times kept per size
    MARGIN = 0.2  # a draft must be expected to beat a plain step by this much: noise is not gain

    def __init__(self) -> None:
        self.times: dict[int, deque[float]] = {}
        # Rank 0's pause after the next NOT_WORTH: it outlives the turn as the cost
        # that set it does, so each turn does not ask again from FIRST_PAUSE up.
        self.quiet = FIRST_PAUSE
        # Rank 0's draft decisions weighed by this cost, over the turns (for probes: a
        # turn asks only a few times, and a cost misjudged under load must be retried).
        self.decisions = 0
        # Seconds per token of the prefill's passes (`prefilled`): the slope of the line
        # until a draft step is timed, so an engine's first reply knows at once whether
        # drafts can pay (on 4-bit weights here a token costs a plain step in a prefill
        # pass as in a draft's), instead of paying a draft and failed asks to learn it.
        self.per_token: float | None = None

    def prefilled(self, per_token: float) -> None:
        """The prefill's seconds per token (exokv.rank.pace), as measured so far."""
        if per_token > 0:
            self.per_token = per_token

    def took(self, tokens: int, seconds: float) -> None:
        """A step ran `tokens` through the model (1: a plain step) in `seconds`."""
        self.times.setdefault(max(1, tokens), deque(maxlen=self.WINDOW)).append(seconds)

    @property
    def one(self) -> float | None:
        """Seconds of a plain step, None until one was timed."""
        return self.estimate(1) if 1 in self.times else None

    def estimate(self, tokens: int) -> float | None:
        """Seconds of a step of `tokens`; None until some step was timed."""
        if self.prefill_only:
            assert self.per_token is not None
            return _low(self.times[1]) + self.per_token * (tokens - 1)
        points = [(n, _low(t), len(t)) for n, t in self.times.items()]
        if len(points) < 2:
            return points[0][1] if points else None
        slope, at = line(points)
        return at + slope * tokens

    @property
    def prefill_only(self) -> bool:
        """Whether the line is a plain step's time and the prefill's slope: no draft
        step timed yet."""
        return list(self.times) == [1] and self.per_token is not None

    def may_ever_pay(self, k: int) -> bool:
        """Whether a draft of up to `k` tokens would pay if every token were kept."""
        return self.worth(k, 1.0) > 0

    def known(self) -> bool:
        """Whether a plain step was timed, and a draft step or the prefill's passes."""
        return 1 in self.times and (len(self.times) >= 2 or self.per_token is not None)

    def speed(self, j: int, rate: float, drafting: float = 0.0) -> float:
        """Expected tokens per second of a step with j draft tokens (`known` first)."""
        seconds = self.estimate(1 + j)
        assert seconds is not None
        return expected_tokens(j, rate) / (seconds + drafting * j)

    def worth(self, k: int, rate: float, drafting: float = 0.0) -> int:
        """The best draft length up to `k`; `drafting`: the seconds each draft token
        costs to propose (a draft model's pass; 0 for the conversation's drafts)."""
        if not self.known() or k <= 0:
            return k  # not measured yet: draft, which measures it
        best, best_speed = 0, self.speed(0, rate) * (1 + self.MARGIN)
        for j in range(1, k + 1):
            speed = self.speed(j, rate, drafting)
            if speed > best_speed:
                best, best_speed = j, speed
        return best

    def table(self, most: int = MOST) -> dict[str, float]:
        """Each step size's estimated cost over a plain step's (what `worth` weighs)."""
        one = self.one
        if one is None or not self.known():
            return {}
        out = {}
        for n in range(1, most + 2):
            seconds = self.estimate(n)
            assert seconds is not None
            out[str(n)] = round(seconds / one, 2)
        return out


def _low(times: Sequence[float]) -> float:
    """A size's time: the second fastest of its times (one freak aside), since a busy
    machine only ever slows a step: a median lets a neighbour's burst in once it
    lasts, and the fastest times are the ones the sizes share whatever the load."""
    ordered = sorted(times)
    return ordered[min(1, len(ordered) - 1)]


def expected_tokens(j: int, rate: float) -> float:
    """Tokens a step with j draft tokens yields: its own and the kept run of the draft."""
    return 1.0 + sum(rate**i for i in range(1, j + 1))


class ModelSource(Protocol):
    """A draft model (exokv.rank.draft_model, rank 0 only): greedy guesses after `tokens`."""

    seconds: float | None  # what one draft token costs to propose, as measured; None: not yet

    def propose(self, tokens: Sequence[int], k: int) -> list[int]: ...


CONVERSATION, MODEL = "conversation", "model"  # where a draft came from

# Why rank 0's draft step drafted what it did (`Drafter.why`; the JSON's
# speculation_detail.why). UNMEASURED: the pass cost is not known yet (neither a draft
# step nor the prefill's passes timed), a START-token draft measures it; BEST: the
# length with the most expected tokens per second;
# PROBE: the longest draft instead, to time it (so a cheap long pass is found even
# when the estimate says otherwise); NOT_WORTH: no draft beats a plain step (drafting
# pauses, twice as long each time); NOTHING: no source had a draft.
UNMEASURED, BEST, PROBE, NOT_WORTH, NOTHING = "unmeasured", "best", "probe", "not_worth", "nothing"


class Acceptance:
    """A draft source's chance that a draft token is kept, given the ones before it.

    Each draft is a run of kept tokens ended by a rejection (or by the draft's end):
    the rate is kept / (kept + rejections), over outcomes that fade by FORGET per
    draft, from a prior of FIRST_RATE worth PRIOR tokens."""

    def __init__(self) -> None:
        self.kept = FIRST_RATE * PRIOR
        self.lost = (1 - FIRST_RATE) * PRIOR

    @property
    def rate(self) -> float:
        return self.kept / (self.kept + self.lost)

    def record(self, drafted: int, accepted: int) -> float:
        self.kept = FORGET * self.kept + accepted
        self.lost = FORGET * self.lost + (1 if accepted < drafted else 0)
        return self.rate


class Drafter:
    """The turn's draft sources and the length policy, together: what decode asks.

    The prefix tree's stored continuation comes first (a whole earlier reply to this
    very context), then prompt lookup in the turn's own tokens, and where both give
    nothing, the draft model (--draft-model), if there is one. Each source has its
    own acceptance rate, and the model's drafts also their own cost, in what `cost`
    decides a draft is worth.

    `propose` runs on rank 0 only: its draft, and after an empty one the pause it
    wants (`wanted_pause`), travel to every rank with the step; the other ranks take
    them (`agreed_pause`), so no rank decides on its own clock."""

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
        self.accepts = {CONVERSATION: Acceptance(), MODEL: Acceptance()}
        self.rate = FIRST_RATE  # a draft token's chance of being kept, as this turn's went
        self.model_rate = FIRST_RATE  # the same for the draft model's drafts
        self.source = ""  # where rank 0's last draft came from (CONVERSATION or MODEL)
        self.model_drafted = 0  # of the turn's draft tokens, the draft model's (rank 0)
        self.decisions = 0  # rank 0's draft decisions weighed by the cost (for probes)
        self.quiet = cost.quiet if cost is not None else FIRST_PAUSE  # rank 0: the
        # pause after the next NOT_WORTH
        self.wanted_pause = FIRST_PAUSE  # rank 0: the pause asked after an empty draft
        self.agreed_pause = FIRST_PAUSE  # the one every rank takes (rank 0's, carried)
        self.why: Counter[str] = Counter()  # rank 0: its draft steps' reasons
        self.lengths: Counter[int] = Counter()  # verify passes by draft length
        self.plain_steps = 0
        self.ahead_steps = 0  # of the plain steps, those computed ahead (decode counts)
        # Whether a source other than prompt lookup (the tree, a draft model) may still
        # draft: rank 0's word, carried with each draft step so every rank holds the
        # same (`may_find`); until then it may.
        self.agreed_others = True
        self._why = ""

    def size(self, room: int) -> int:
        return 0 if self.warming() else self.length.next(room)

    def warming(self) -> bool:
        """Whether no plain step of this engine has been timed yet: until one is, a
        draft cannot be weighed, and a step that asks loses its computing ahead (on
        two pipeline ranks about a step's time each). The plain steps are timed at
        the same steps on every rank, so every rank answers alike."""
        return self.cost is not None and 1 not in self.cost.times

    def others_may_draft(self) -> bool:
        """Rank 0: whether the tree or the draft model may draft after the next token."""
        tree = self.tree is not None and self.tree.node is not None
        return tree or self.model is not None

    def may_find(self) -> bool:
        """Whether a draft step after the next token (not known yet) could find a
        draft; when not, asking would only cost that step its computing ahead."""
        if self.warming():
            return False
        return self.agreed_others or self.lookup.may_find_after_next()

    def plain_after(self, asked: int, room: int) -> bool:
        """Whether the step after a plain one (one token; `asked`: the draft it asked
        for, which came empty) is plain too, before that token is known: so its
        forward pass can start at once. Every rank answers alike."""
        if not self.may_find():
            return True
        if asked:
            return self.agreed_pause > 1 or room <= 2  # an empty draft step: a pause
        return self.length.pause > 1 or room <= 2

    def _choose(self, k: int, rate: float, drafting: float = 0.0) -> int:
        """Rank 0's draft length up to `k` for a source kept at `rate`, and why."""
        if self.cost is None or not self.cost.known():
            self._why = UNMEASURED
            return min(k, START) if self.cost is not None else k
        best = self.cost.worth(k, rate, drafting)
        self.decisions += 1
        self.cost.decisions += 1
        if best < k and rate >= PROBE_RATE and self.cost.decisions % PROBE_EVERY == 0:
            self._why = PROBE
            return k
        self._why = BEST if best else NOT_WORTH
        return best

    def _untimed_may_pay(self, k: int) -> bool:
        cost = self.cost
        return (
            cost is not None
            and cost.prefill_only
            and self.rate >= PROBE_RATE
            and cost.may_ever_pay(k)
        )

    def propose(self, k: int) -> list[int]:
        """Rank 0's draft of at most `k` tokens (fewer where a longer one is not worth
        its pass, by `cost`)."""
        self.source = ""
        free = self._choose(k, self.rate)
        # The prefill's line alone (no draft step timed) judges a draft by its guessed
        # rate: where a draft kept whole would pay, one the conversation has is drafted
        # whole (a probe) so the model's own pass is timed, and quoting is found to pay.
        untimed = free == 0 and self._untimed_may_pay(k)
        if free > 0 or untimed:
            n = k if untimed else free
            stored = self.tree.propose(n) if self.tree is not None else []
            found = stored or self.lookup.propose(n)
            if found:
                if untimed:
                    self._why = PROBE
                return self._drafting(CONVERSATION, found)
        why = NOTHING if free > 0 else self._why
        if self.model is not None and (self.cost is None or self.cost.one is not None):
            # (Without a plain step timed the model's drafts cannot be weighed against
            # their own time, and a model that always drafts would never leave one.)
            j = self._choose(k, self.model_rate, self.model.seconds or 0.0)
            if j > 0:
                guessed = self.model.propose(self.lookup.tokens, j)
                if guessed:
                    self.model_drafted += len(guessed)
                    return self._drafting(MODEL, guessed)
            why = NOTHING if j > 0 else self._why
        self.why[why] += 1
        if why == NOT_WORTH:
            # Plain steps are cheapest while no draft pays: fewer draft steps, each
            # longer apart, as long as drafts keep not paying; the longest at once
            # where not even a draft that is always kept would pay (4-bit weights
            # here), since asking more often cannot find one that does.
            if self.cost is not None and not self.cost.may_ever_pay(self.length.most):
                self.quiet = LONGEST_PAUSE
            self.wanted_pause, self.quiet = self.quiet, min(2 * self.quiet, LONGEST_PAUSE)
            if self.cost is not None:
                self.cost.quiet = self.quiet
        else:
            self.wanted_pause = FIRST_PAUSE
        return []

    def _drafting(self, source: str, draft: list[int]) -> list[int]:
        self.source = source
        self.why[self._why] += 1
        if self._why == BEST:
            self.quiet = FIRST_PAUSE
            if self.cost is not None:
                self.cost.quiet = FIRST_PAUSE
        return draft

    def advance(self, drafted: int, accepted: int, new: Sequence[int], asked: int = 0) -> None:
        """A step's outcome: `drafted` proposed (of `asked`, 0 on a plain step),
        `accepted` kept, `new` tokens decoded."""
        if drafted:
            if accepted and self.cost is not None:
                self.quiet = self.cost.quiet = FIRST_PAUSE  # drafts pay again: ask often
            self.lengths[drafted] += 1
            rate = self.accepts[self.source or CONVERSATION].record(drafted, accepted)
            if self.source == MODEL:
                self.model_rate = rate
            else:
                self.rate = rate
        else:
            self.plain_steps += 1
        self.source = ""
        self.length.record(drafted, accepted)
        self.length.decoded(len(new))
        if asked and not drafted:
            self.length.pause_for(self.agreed_pause)  # after this step's tokens
        self.lookup.extend(new)
        if self.tree is not None:
            self.tree.extend(new)

    def detail(self) -> dict[str, Any]:
        """Why the turn drafted what it did (rank 0's; the JSON's speculation_detail)."""
        cost = self.cost
        one = cost.one if cost is not None else None
        return {
            "plain_steps": self.plain_steps,
            "ahead_steps": self.ahead_steps,
            "verify_passes": {str(n): c for n, c in sorted(self.lengths.items())},
            "why": dict(sorted(self.why.items())),
            "acceptance": {CONVERSATION: round(self.rate, 3), MODEL: round(self.model_rate, 3)},
            "plain_step_s": round(one, 4) if one is not None else None,
            "pass_cost": cost.table(self.length.most) if cost is not None else {},
        }


class ScriptedDrafter(Drafter):
    """Tests only (EXOKV_TEST_DRAFTS): drafts a reply from a given token list, what
    follows the reply's length in it, with every third of its tokens made wrong, so
    a verify pass meets right and wrong tokens on models that never repeat text."""

    def __init__(self, tokens: Sequence[int], script: Sequence[int], most: int = MOST) -> None:
        super().__init__(tokens, most)
        self.prompt = len(tokens)
        self.script = list(script)

    def may_find(self) -> bool:
        return True  # the script drafts at any step

    def propose(self, k: int) -> list[int]:
        at = len(self.lookup.tokens) - self.prompt
        return [t + 1 if (at + i) % 3 == 2 else t for i, t in enumerate(self.script[at : at + k])]
