"""Speculative decoding: a cheap drafter proposes K tokens, one target forward
over K+1 positions checks them all.

The target's forward over [current token, draft 1..K] gives its own
distribution at every one of those positions. Greedy: the drafts are kept
while they equal the target's choice, and the target's choice at the first
mismatch (or after the last draft) comes free. Sampling: draft token d,
proposed with probability q(d), is kept with probability min(1, p(d)/q(d));
at the first rejection the token is drawn from the residual max(0, p - q),
normalized, and after K kept drafts one more from p (Leviathan et al. 2023;
Chen et al. 2023). Either way the output is distributed as plain decoding's:
greedy, token for token. A deterministic drafter (prompt lookup) has a
one-hot q.

Keys and values are rolled back by position, not copied: the verify forward
writes them at every position it reads, and positions past the kept tokens
are written again before anything attends to them.

Drafters:
  NgramDrafter: prompt lookup, the continuation of the longest context
                ending the history that occurred before (a hash table per
                context length, kept as the history grows), as often seen
                and as long as its repeats agreed; optionally from earlier
                runs' texts too (SuffixDecoding, Oliaro et al. 2024).
  ModelDrafter: a model run token by token, either the target's first
                `depth` layers with its final norm and output layer (sharing
                the target's weights and those layers' cache), or a smaller
                model of its own with its own cache.

DraftPolicy chooses how many drafts each step proposes, from the measured
cost of a step with k drafts (kept by the generator across runs) and how
often this run's drafts are kept.
"""
from __future__ import annotations

import torch

from .model import Transformer, cached_prefix
from .sampling import SamplingParams, as_settings, draw, logits_to_probs, sample

CONTEXTS = (16, 12, 8, 6, 4, 3, 2, 1)  # context lengths looked up, longest first
CANDIDATES = 4  # earlier occurrences of the matched context weighed (the latest ones)
BOUNDARY = -1  # between texts of one index: no context spans it, no draft crosses it


class TokenIndex:
    """Texts of tokens (joined by BOUNDARY) indexed by context: for each n in
    CONTEXTS, a hash table from the n tokens before a position to the latest
    such position, and for each position the one before it after the same n
    tokens (a chain, so the earlier occurrences come at no search). Indexing
    a position costs one table update per n however long the text; a lookup,
    one read per n and a walk of CANDIDATES links. The tables hold hashes,
    not tuples: no garbage for the collector to trace, and a rare collision
    only costs a draft."""

    def __init__(self):
        self.tokens: list[int] = []
        self.indexed = 1  # positions below this are indexed (position 0 has no context)
        self.start = 0  # where the text being indexed starts (after the latest boundary)
        # per n: the hash of the n tokens before p -> the latest p, and p -> the p before it
        # after the same n tokens (or -1)
        self.levels = [(n, {}, [-1]) for n in CONTEXTS]

    def index(self, end: int):
        """Index the positions below end (each a token after its context)."""
        tokens, levels = self.tokens, self.levels
        for p in range(self.indexed, end):
            if tokens[p - 1] == BOUNDARY:
                self.start = p
            window = tuple(tokens[max(self.start, p - CONTEXTS[0]):p])
            usable = 0 if tokens[p] == BOUNDARY else len(window)
            for n, latest, chain in levels:
                if n > usable:
                    chain.append(-1)
                    continue
                key = hash(window[-n:])
                chain.append(latest.get(key, -1))
                latest[key] = p
        self.indexed = max(self.indexed, end)

    def occurrences(self, level: int, key: int, limit: int) -> list[int]:
        """The latest CANDIDATES positions below limit after the tokens hashed
        as key (CONTEXTS[level] of them), latest first."""
        _, latest, chain = self.levels[level]
        found, p = [], latest.get(key, -1)
        while p >= 0 and len(found) < CANDIDATES:
            if p < limit:
                found.append(p)
            p = chain[p]
        return found

    def continuation(self, p: int, k: int, limit: int) -> list[int]:
        """Up to k tokens from position p, not past limit nor a boundary."""
        run = self.tokens[p:min(p + k, limit)]
        return run[:run.index(BOUNDARY)] if BOUNDARY in run else run


def agreement(a: list[int], b: list[int]) -> int:
    """How many leading tokens a and b share."""
    same = 0
    for x, y in zip(a, b):
        if x != y:
            break
        same += 1
    return same


def likeliest(runs: list[list[int]]) -> list[int]:
    """The draft from the continuations of a context's earlier occurrences
    (latest first): the latest of those whose first token followed the
    context most often, cut one token past the longest that it agreed with
    another occurrence's continuation. A context seen once drafts all of its
    continuation; one whose repeats parted at once, a single token."""
    runs = [r for r in runs if r]
    if len(runs) < 2:
        return runs[0] if runs else []
    firsts = [r[0] for r in runs]
    best = max(runs, key=lambda r: firsts.count(r[0]))  # (max keeps the first of ties: the latest)
    others = [r for r in runs if r is not best]
    if not others:
        return best
    return best[:1 + max(agreement(best, r) for r in others)]


class NgramDrafter:
    """Prompt lookup: no second model. The draft continues the longest
    context (of CONTEXTS' lengths) ending the history that occurred before,
    from its latest occurrences (TokenIndex, updated as the history grows:
    a step's lookup costs the same at any length): the continuation seen
    most often, as long as earlier repeats of the context kept agreeing
    (likeliest).

    remember: also draft from earlier runs' histories (their prompts and
    outputs, as SuffixDecoding does: a server's agentic or repeated-edit
    requests reuse their own earlier text), about MEMORY_TOKENS of the
    latest: two indexes, the older dropped whole when the newer fills
    half. The current history's own occurrences are the latest, so they win
    ties; a chat's next turn, which repeats the last one, extends its text
    rather than copying it."""

    MEMORY_TOKENS = 1 << 15

    def __init__(self, remember: bool = False):
        self.remember = remember
        self.index, self.earlier = TokenIndex(), None
        self.history, self.offset = None, 0  # history[i] is self.index.tokens[self.offset + i]

    def propose(self, history: list[int], k: int, params: SamplingParams, run=None, shortest: int = 1):
        """Up to k tokens following history, and None (the proposal is one-hot);
        none from a context shorter than `shortest`."""
        return self._lookup(history, len(history), k, shortest), None

    def _follow(self, history: list[int], end: int):
        """Make the index hold history[:end] and the positions before it."""
        if history is not self.history or len(history) < len(self.index.tokens) - self.offset:
            self._start(history)
        tokens = self.index.tokens
        have = len(tokens) - self.offset
        if have < end:
            tokens.extend(history[have:end])
        self.index.index(self.offset + end)

    def _start(self, history: list[int]):
        """A new run's history: a fresh index, or (remembering) the next text of this one."""
        if not self.remember:
            self.index, self.offset, self.history = TokenIndex(), 0, history
            return
        tokens = self.index.tokens
        if self.history is not None:  # (the last run's tokens after its last lookup)
            tokens.extend(self.history[len(tokens) - self.offset:])
        last, self.history = tokens[self.offset:], history
        if last and history[:len(last)] == last:  # (it continues the last text: a chat's next turn)
            return
        if len(tokens) > self.MEMORY_TOKENS // 2:
            self.index.index(len(tokens))
            self.earlier, self.index = self.index, TokenIndex()
            tokens = self.index.tokens
        if tokens:
            tokens.append(BOUNDARY)
        self.offset = len(tokens)

    def _lookup(self, history: list[int], end: int, k: int, shortest: int = 1) -> list[int]:
        """The draft of up to k tokens after history[:end], from a context of at least `shortest` tokens."""
        self._follow(history, end)
        limit = self.offset + end  # (the current text's positions past it are not known yet at end)
        window = tuple(history[max(0, end - CONTEXTS[0]):end])
        indexes = [(self.index, limit)]
        if self.earlier is not None:
            indexes.append((self.earlier, len(self.earlier.tokens)))
        for level, n in enumerate(CONTEXTS):
            if n > len(window) or n < shortest:
                continue
            key, runs = hash(window[-n:]), []
            for index, stop in indexes:
                if len(runs) < CANDIDATES and key in index.levels[level][1]:
                    runs += [index.continuation(p, k, stop) for p in index.occurrences(level, key, stop)]
            if runs:
                return likeliest(runs[:CANDIDATES])
        return []

    def judge(self, history: list[int], first: int, k: int, end: int | None = None,
              shortest: int = 1) -> tuple[int, int]:
        """(drafts judged, drafts kept) had k drafts been proposed (from
        contexts of at least `shortest` tokens) before each of
        history[first:end] (tokens plain decoding made): the chance of keeping
        a draft, learnt for free while decoding plainly. As in a verify step, a
        proposal's first wrong draft ends its judging."""
        judged = kept = 0
        for at in range(first, len(history) if end is None else end):
            drafts = self._lookup(history, at, k, shortest)
            right = next((i for i, (d, t) in enumerate(zip(drafts, history[at:])) if d != t),
                         min(len(drafts), len(history) - at))
            kept += right
            judged += right + (right < len(drafts) and at + right < len(history))
        return judged, kept

    def kept(self, length: int):
        pass


class ModelDrafter:
    """Drafts by running `model` one token at a time.

    With depth (and model the target itself) it runs the first `depth` layers
    only: their keys and values at the positions it drafts are the ones the
    verify forward writes again for the same tokens, so the cache is shared
    and always current. A separate draft model keeps its own cache, and
    `cached` lists the tokens whose keys it holds."""

    def __init__(self, model: Transformer, depth: int | None = None):
        self.model, self.depth = model, depth
        self.shares_cache = depth is not None
        self.cached: list[int] = []
        # A draft model is chosen to agree with the target: the policy looks at once (StepCosts.paying).
        # The target's first layers, untrained to draft, seldom do (RESULTS: never on SmolLM2's 8 of 30).
        self.hopeful = depth is None

    def propose(self, history: list[int], k: int, params: SamplingParams, run):
        """k tokens after history (its last token not yet in any cache), and
        their proposal distributions (k, V) when sampling (None when greedy).
        run: Generator.logits (compiled or replayed steps), which takes ids
        as a list or as a (1,) tensor on the device."""
        # (a separate draft model catches up from the longest prefix it holds)
        start = len(history) - 1 if self.shares_cache else cached_prefix(self.cached, history, len(history) - 1)
        feed = history[start:]
        drafts, probs = [], []
        settings = params.on(self.model.device)  # (once: a copy from the host waits for the device)
        for _ in range(k):  # each draft fed to the next step on the device: no host read until the last
            logits = run(feed, start, model=self.model, last=len(feed) - 1, depth=self.depth)[:, -1]
            if not params.greedy:
                probs.append(logits_to_probs(logits, settings)[0])
            drafts.append(sample(logits, settings).reshape(1))
            start += len(feed)
            feed = drafts[-1]
        drafts = torch.cat(drafts).tolist()
        self.cached = [*history, *drafts[:-1]]  # (the last draft's keys were never written)
        return drafts, (torch.stack(probs) if probs else None)

    def kept(self, length: int):
        """Only the first `length` positions hold tokens of the history now."""
        del self.cached[length:]


def accept(logits: torch.Tensor, drafts: list[int], q: torch.Tensor | None, params,
           choose=None) -> list[int]:
    """The tokens a verify step emits: the kept drafts and one more.

    logits (len(drafts) + 1, V): the target's at the current token and at
    each draft. q: the drafts' proposal distributions (None: one-hot).
    params: SamplingParams, or better its `on` form already on the device
    (built from host values behind the forward, it would wait for it).
    Sampled, every row's test and its residual token are drawn on the
    device by `choose` (sampled_choices, or a CUDA graph of it: one launch
    for its ~20), queued behind the forward, and read in one transfer."""
    settings = as_settings(params, logits.device)
    if settings is None:
        target = sample(logits, None).tolist()
        kept = 0
        while kept < len(drafts) and drafts[kept] == target[kept]:
            kept += 1
        return drafts[:kept] + [target[kept]]
    k = len(drafts)
    ids = torch.tensor(drafts, pin_memory=logits.is_cuda).to(logits.device, non_blocking=True)
    read = (choose or sampled_choices)(logits, ids, q, settings).tolist()
    kept = read.index(0)  # (the first rejected draft's row, or k: every draft kept)
    return drafts[:kept] + [read[k + 1 + kept]]


def sampled_choices(logits: torch.Tensor, ids: torch.Tensor, q: torch.Tensor | None,
                    settings: torch.Tensor) -> torch.Tensor:
    """accept's device work, sampled, with no read to the host: (2k + 2,)
    ids, each draft's test (1: kept) and a 0, then each row's token were
    the drafts before it kept and its own rejected (the last row's: the
    token after every draft). ids (k,): the drafts on the device."""
    p = logits_to_probs(logits, settings)  # (k + 1, V)
    k = ids.shape[0]
    rows = torch.arange(k, device=p.device)
    p_d = p[rows, ids]
    q_d = torch.ones_like(p_d) if q is None else q[rows, ids].to(p.dtype)
    keep = torch.rand(k, device=p.device, dtype=p.dtype) * q_d < p_d  # kept with probability min(1, p/q)
    if q is None:
        residual = p[:k].scatter(-1, ids[:, None], 0.0)  # (no index_put of a host scalar: a graph captures it)
    else:
        residual = (p[:k] - q.to(p.dtype)).clamp(min=0)
    # (p == q: a rejection there has probability 0; its row's residual is never used)
    residual = torch.where(residual.sum(-1, keepdim=True) > 0, residual, p[:k])
    tokens = draw(torch.cat([residual, p[k:]]))  # each row's token were it rejected (no multinomial: a graph
    return torch.cat([keep.long(), keep.new_zeros(1, dtype=torch.long), tokens])  # holds the race's launches)


class StepCosts(dict):
    """What a drafter's runs share (DraftPolicy): drafts a step -> seconds a
    step; the plain steps since a drafting step was last measured (older
    drafting costs are forgotten); the probes' schedule (plain steps since
    the last failed probe, the wait it set, the wait the next failure sets);
    and `paying`: whether its drafts were kept when it last drafted, or,
    before it has, whether they are expected to be (ModelDrafter.hopeful)."""
    plain_since_drafting = 0
    since_probe, wait, interval = 0, 0, 16

    def __init__(self, costs=(), paying: bool = False):
        super().__init__(costs)
        self.paying = paying


class DraftPolicy:
    """How many drafts to propose at each step: the k in 0..max_k that gives
    the most tokens per second, from what has been measured.

    A step with k drafts yields 1 + a + a^2 + ... + a^k tokens on average if
    each draft is kept with probability a, and costs the seconds measured for
    steps with k drafts (drafting and verifying). A k not tried yet is costed
    on the line through the nearest tried drafting steps (not through the
    plain step, which has no verify's fixed cost): a model drafter's steps
    grow by a draft step each, a verify step by a little. The costs are the
    generator's (`costs`, kept across its runs with this drafter), the
    chance of keeping a draft this run's: text decides it.

    A run starts with one draft (a first look at the chance) where a probe
    is due, else with plain steps until one is, and measures a run of plain
    steps if no run has. Drafts that keep being rejected drive k to 0, and
    the run decodes as plainly as without a drafter (in runs of plain steps
    queued ahead, as plain decoding's loop does: on a GPU a step that waits
    for the host costs that wait too), but for a probe with one draft now
    and then. A failed probe waits longer before the next one: twice as
    long each time (from 16 steps to 256), and at least as long as keeps
    the probes' extra cost under PROBE_SHARE of the time (a self-draft's
    probe on a small launch-bound model costs 2.5 plain steps); the wait
    counts the plain steps of later runs too (StepCosts).

    Unless the drafter's drafts were kept when it last drafted, a probe
    also waits for plain steps of its own run: FIRST_LOOK, or as many as
    keep that probe's extra cost under PROBE_SHARE of the run. A probe's
    cost is unknown before the first, and a reply of 16 tokens whose first
    step probed lost 9% to it on a GPU (up to 28% sampled): no reply pays
    a probe it is too short to pay for. The price: a self-draft whose drafts
    would be kept starts drafting after FIRST_LOOK tokens of its first
    reply (later replies look at once); a separate draft model, chosen to
    agree with the target, is taken as kept until a probe fails. So
    speculating on text where it cannot pay costs a few percent at most, in
    each reply.

    A drafter that judges its drafts for free (prompt lookup: NgramDrafter.judge
    asks what it would have proposed before each token plain decoding made)
    needs no probes: the run starts plain, the chance is learnt from the plain
    tokens, and drafting starts only where the measured step costs say it
    pays; between choices the plain runs grow from 16 to 128 steps. Its
    drafting costs are forgotten after STALE_AFTER plain steps without a
    drafting step (across runs): one measured while the machine was slow
    would otherwise stop drafting for good, since only drafting measures
    them again; where the text then says drafting pays, a step measures."""

    PROBE_SHARE = 0.02
    FIRST_LOOK = 64  # plain steps of a run before its probe, where no drafts were kept before
    FIRST_PLAIN_RUN = 8  # plain steps that measure a plain step's cost
    JUDGED_RUN = 16  # plain steps between choices, where the drafter judges its drafts for free
    ONE_OFF = 4  # a first drafting step dearer than this many plain ones is measured again
    DOUBT = 3  # rejections assumed before any judged draft, where judging is free
    # The discount of the record a judged draft: the record holds about 1 / (1 - it) drafts, so
    # the chance it gives is at most about that many over DOUBT more (0.85 capped it near 0.7,
    # under which 8 drafts promise 3.2 tokens: not enough where a verify costs 3 plain steps, as
    # 9 rows do on 2 CPU cores, however well the text copies)
    JUDGED_DECAY = 0.93
    MARGIN = 0.1  # drafting must promise this much more than plain steps: the chance is an estimate
    # Prompt lookup drafts from no context shorter than this: outside copied text, a draft after
    # one or two matched tokens (a common word) is kept too seldom to pay for its verify (over
    # the speculation benchmark's plain outputs, 0.31 of a 1-token context's drafts would have
    # been kept, 0.54 of a 2-token one's, 0.99 of a 16-token one's), and failed verifies are what
    # made replies slower than plain decoding (RESULTS: 32 of 32 rows at 0.97x or better on a GPU,
    # at a cost on copied text, where a short context picks the copy up again after an edit).
    SHORTEST_CONTEXT = 3
    STALE_AFTER = 1024  # plain steps after which a free-judging drafter's drafting costs are forgotten

    def __init__(self, max_k: int, decay: float = 0.85, costs: StepCosts | dict[int, float] | None = None,
                 free_judging: bool = False):
        self.max_k, self.decay = max_k, decay
        # free_judging: the drafter judges its drafts against plain decoding's tokens
        # (NgramDrafter.judge) at no device cost, so no probe is needed to learn the chance
        self.free_judging = free_judging
        self.doubted = set()  # drafts a step whose first, one-off cost was not kept
        self.judged_run = self.JUDGED_RUN // 2  # the next run of judged plain steps, halved
        # drafts proposed -> seconds a step (moving average); a StepCosts is kept and shared as given
        self.cost = costs if isinstance(costs, StepCosts) else StepCosts(costs or {})
        # Drafts kept and drafts judged (the first rejection ends a step's
        # judging), discounted by `decay` a step (JUDGED_DECAY a draft judged
        # for free). The chance that a draft is kept is taken as (kept + 1) /
        # (judged + 1): hopeful while little is known, the measured fraction
        # once much is; where judging is free, kept / (judged + DOUBT):
        # doubtful until the text shows otherwise.
        self.judged = self.kept_count = 0.0
        self.probing = False  # whether the step chosen last is a probe
        self.run = 1  # plain steps to take where choose() gave 0
        self.plain_in_run = 0  # plain steps this run has taken

    @property
    def kept(self) -> float:
        if self.free_judging:  # (evidence is free: drafting waits for it, as one failed verify
            return self.kept_count / (self.judged + self.DOUBT)  # costs a short reply its 3%)
        return (self.kept_count + 1) / (self.judged + 1)

    def expected_tokens(self, k: int) -> float:
        return sum(self.kept ** i for i in range(k + 1))

    def step_cost(self, k: int) -> float:
        if k in self.cost:
            return self.cost[k]
        # (from the drafting steps tried alone: each holds a verify's fixed cost, which a plain step has not)
        tried = sorted(j for j in self.cost if j > 0)
        if not tried:
            return self.cost[0]  # (hopeful: the first drafting step measures it)
        below = [j for j in tried if j < k][-2:]
        above = min((j for j in tried if j > k), default=None)
        if not below:  # fewer drafts than any tried: no dearer than the fewest tried
            return self.cost[above]
        if above is None:  # past the largest tried: on from the two largest, never cheaper
            if len(below) < 2:
                return self.cost[below[-1]]
            (j0, c0), (j1, c1) = ((j, self.cost[j]) for j in below)
            return c1 + max(c1 - c0, 0.0) / (j1 - j0) * (k - j1)
        w = (k - below[-1]) / (above - below[-1])
        return (1 - w) * self.cost[below[-1]] + w * self.cost[above]

    def choose(self, room: int) -> int:
        """Drafts to propose now (at most room, the tokens still wanted after this one)."""
        self.run = 1
        top = min(self.max_k, room)
        if top == 0:
            return 0
        if self.free_judging and (self.judged == 0 or 0 not in self.cost):  # plain steps first: judged meanwhile
            self.run = self.FIRST_PLAIN_RUN
            return 0
        if self.judged == 0 and self._probe_due():  # (this run's text is unknown yet: a first look)
            self.probing = True
            return 1
        if 0 not in self.cost:  # a plain step's cost, measured over a run queued ahead as plain decoding's
            self.run = self.FIRST_PLAIN_RUN  # (one step alone would count the host's wait for the device)
            return 0
        if self.free_judging:  # no probes: the plain steps are judged, in runs that grow while drafts
            best = max(range(top + 1), key=self.rate)  # would not pay
            self.judged_run = 2 * self.judged_run if best == 0 else self.JUDGED_RUN // 2
            self.run = min(self.judged_run, 8 * self.JUDGED_RUN)  # (each run ends in a wait for the host)
            return best
        best = max(range(top + 1), key=self.rate) if self.judged else 0  # (no look yet: the prior is no evidence)
        if best == 0:
            if self._probe_due():
                self.probing = True
                return 1
            self.run = self._until_probe()
        return best

    def _share_wait(self) -> int:
        """Plain steps that keep a probe's extra cost under PROBE_SHARE of theirs (0: not measured)."""
        cost = self.cost
        return int((cost[1] / cost[0] - 1) / self.PROBE_SHARE) + 1 if 0 in cost and 1 in cost else 0

    def _until_probe(self) -> int:
        """Plain steps until a probe is due: after a failed probe, the
        schedule's wait (or more, where a probe costs so much more than a
        plain step that PROBE_SHARE asks it); and unless drafts were kept
        last, this run's own share (see the class's docstring)."""
        cost, share = self.cost, self._share_wait()
        due = (max(cost.wait, share) if cost.wait else 0) - cost.since_probe
        if not cost.paying:
            due = max(due, max(self.FIRST_LOOK, share) - self.plain_in_run)
        return due

    def _probe_due(self) -> bool:
        return self._until_probe() <= 0

    def pays(self, room: int) -> bool:
        """Whether drafting now would give more tokens a second than plain steps
        (a free-judging drafter's plain run asks as its tokens are judged);
        never before a draft has been judged (the chance is only the prior's)."""
        return self.judged > 0 and any(self.rate(k) > self.rate(0) for k in range(1, min(self.max_k, room) + 1))

    def rate(self, k: int) -> float:
        """Tokens a second expected of steps with k drafts, drafting's discounted by MARGIN."""
        return self.expected_tokens(k) / self.step_cost(k) / (1 + self.MARGIN if k else 1)

    def plain_steps(self) -> int:
        """Where choose() gave 0: the plain steps to take before asking again
        (until the next probe; FIRST_PLAIN_RUN while a plain step's cost is
        first measured), run as plain decoding runs them, each queued before
        the token it follows is read."""
        return self.run

    def _age(self, plain_steps: int):
        """Count plain steps since a drafting step was measured; past
        STALE_AFTER, a free-judging drafter's drafting costs are dropped."""
        if not self.free_judging:
            return
        self.cost.plain_since_drafting += plain_steps
        if self.cost.plain_since_drafting >= self.STALE_AFTER:
            for k in [k for k in self.cost if k > 0]:
                del self.cost[k]
            self.cost.plain_since_drafting = 0

    def observe(self, judged: int, kept: int):
        """Drafts judged and kept without being proposed (NgramDrafter.judge)."""
        weight = self.JUDGED_DECAY ** judged  # (a position with no draft is no evidence either way)
        self.kept_count = weight * self.kept_count + kept
        self.judged = weight * self.judged + judged

    def update(self, proposed: int, kept: int, seconds: float, steps: int = 1):
        """After `steps` steps (more than one: plain ones) with `proposed`
        drafts each (a drafter may find fewer than asked), the drafts kept,
        and the seconds they took."""
        seconds /= steps
        old = self.cost.get(proposed)
        one_off = (old is None and proposed and self.free_judging and proposed not in self.doubted
                   and seconds > self.ONE_OFF * self.cost.get(0, seconds))
        if not proposed and steps == 1 and old is not None:
            pass  # (a lone plain step waits for the host: not what plain steps queued ahead cost)
        elif one_off:  # (mostly one-off work, a CUDA graph's capture: with no probes to correct it,
            self.doubted.add(proposed)  # kept as the cost it would stop drafting for good)
        else:  # a step slower than its cost so far moves it by a fifth; a faster one is its cost now
            self.cost[proposed] = seconds if old is None else min(seconds, 0.8 * old + 0.2 * seconds)
        cost = self.cost
        if not proposed:
            cost.since_probe += steps
            self.plain_in_run += steps
            self._age(steps)
            return
        cost.plain_since_drafting = 0
        self.kept_count = self.decay * self.kept_count + kept
        self.judged = self.decay * self.judged + kept + (kept < proposed)
        if kept:
            cost.interval, cost.paying = 16, True
        elif self.probing:  # wait longer before the next probe
            cost.since_probe, cost.wait, cost.interval = 0, cost.interval, min(2 * cost.interval, 256)
            cost.paying = False
        self.probing = False
