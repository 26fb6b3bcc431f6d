"""A synthetic support-ticket triage task: the data the embedded demo model is trained and tested on.

Every example is a ``/v1/systemone`` request whose state is a support ticket (a JSON object with the
channel, the customer and the message, in one of several layouts, or a plain string) and whose three
questions use all three Clef question types:

- a ``choice`` of the team that handles the ticket (4–6 labels drawn from aliases, in shuffled order;
  the ticket may mention another team's topic as a distractor, and its history names earlier teams),
- a ``score`` of urgency over 4 levels: the level of the urgency cue in the message (normal when there is
  none), one level higher for ``enterprise`` customers, at most the top level,
- a ``noul``: does the customer ask for a refund now (a refund that is declined or already received
  does not count).

Phrasings come from two disjoint template sets: ``templates="train"`` for training and
``templates="heldout"`` for evaluation (other issue sentences, frames, distractors, question wordings,
descriptions, state layouts, greetings and closings, and other sentences around the urgency and refund
cues). The words and short phrases that decide an answer (team topics, urgency cues such as "today" or
"right now", refund requests and their negations, label aliases, plan names) are shared, as they would
be between a training set and real traffic: a model this small learns words, not English. Training also
puts half of those phrases between random neutral words instead of a carrier sentence, so that a model
learns the phrase rather than the frame around it.
Deterministic for a given ``seed`` and ``templates``.
"""

from __future__ import annotations

import random
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Literal

Templates = Literal["train", "heldout"]
TEMPLATE_SETS: tuple[str, ...] = ("train", "heldout")
TEAMS = ("billing", "technical", "shipping", "account", "sales")
URGENCY_LEVELS = 4
PLANS = ("free", "pro", "enterprise")

# Label aliases per team: one is picked per question (shared by both template sets).
TEAM_LABELS = {
    "billing": ("billing", "payments", "finance"),
    "technical": ("technical", "tech_support", "engineering"),
    "shipping": ("shipping", "logistics", "delivery"),
    "account": ("account", "accounts", "identity"),
    "sales": ("sales", "commercial", "presales"),
}
# Options that are never the answer, added now and then so the option count varies.
EXTRA_LABELS = {
    "legal": ("Contracts, terms and legal requests", None),
    "press": ("Journalists and media enquiries", None),
    "careers": ("Job applications", None),
}

# Noun phrases that name each team's topic. Both template sets use them: inside the sentences of the
# problem (training frames below), as another team's topic in distractor sentences, in ticket histories.
TEAM_KEYS = {
    "billing": ("my invoice", "the payment", "my credit card", "the receipt", "the subscription fee",
                "a charge on my statement", "the billing address", "the VAT number on the invoice"),
    "technical": ("the app", "error {code}", "the dashboard", "the API", "the sync", "the export button",
                  "the file upload", "the search page"),
    "shipping": ("my package", "the tracking number", "the courier", "the parcel",
                 "the delivery of order {order}", "the wrong item in the box", "a damaged box"),
    "account": ("my password", "the password reset email", "the two-factor login", "my locked account",
                "my username", "my profile", "the email address on my account"),
    "sales": ("a quote for {seats} seats", "pricing", "a discount", "the upgrade to the pro plan", "a demo",
              "the annual plan", "extra licences", "a partnership"),
}
# Sentences around a team key, for the problem itself.
ISSUE_FRAMES = {
    "train": ("I have a problem with {core}.", "There is an issue with {core}.",
              "Something is wrong with {core}.", "I have a question about {core}.",
              "Can you help me with {core}?", "My message is about {core}.", "Please check {core}.",
              "{Core} does not work as expected.", "We need help with {core}.", "Writing about {core}."),
    "heldout": ("Regarding {core}: it is not right.", "I am contacting you about {core}."),
}
# Whole sentences of the problem, per team. Slots: {order} {amount} {code} {seats} {month} {email}.
ISSUES: dict[str, dict[str, tuple[str, ...]]] = {
    "train": {
        "billing": (
            "I was charged twice for order {order}.",
            "My invoice for {month} shows {amount} but my plan costs less.",
            "The payment for my subscription failed even though my card is valid.",
            "Why did you bill me {amount} this month?",
            "I need a copy of the receipt for my last payment.",
            "My credit card was charged after I cancelled the subscription.",
            "There is a charge of {amount} on my statement that I do not recognise.",
            "Please update the billing address on my invoices.",
            "The invoice has the wrong VAT number on it.",
        ),
        "technical": (
            "The app crashes every time I open the settings page.",
            "I get error {code} when I try to upload a file.",
            "The dashboard has been loading forever since this morning.",
            "Your API returns a timeout for every request.",
            "The sync between my phone and the web app stopped working.",
            "After the last update the export button does nothing.",
            "Pages load extremely slowly and sometimes show a blank screen.",
            "The integration with our calendar keeps throwing error {code}.",
            "The search in the app returns no results at all.",
        ),
        "shipping": (
            "My package for order {order} has not arrived yet.",
            "The tracking number for order {order} shows no movement for a week.",
            "The courier left the parcel at the wrong address.",
            "The box arrived damaged and the item inside is broken.",
            "I received the wrong item in my delivery.",
            "Can you change the delivery address for order {order}?",
            "The delivery was marked as delivered but nothing is at my door.",
            "Half of my order {order} is missing from the parcel.",
            "The courier never showed up during the delivery window.",
        ),
        "account": (
            "I cannot log in because the password reset email never arrives.",
            "Please change the email address on my account to {email}.",
            "My account was locked after too many login attempts.",
            "I lost my phone and cannot pass the two-factor check.",
            "Someone else may have access to my account.",
            "I want to delete my account and all my data.",
            "How do I add a second user to my profile?",
            "My username is wrong and I cannot change it myself.",
            "The password reset link says it has expired.",
        ),
        "sales": (
            "We would like a quote for {seats} seats on the business plan.",
            "Do you offer a discount for non-profit organisations?",
            "I want to upgrade from the basic plan to the pro plan.",
            "Can someone show our team a demo of the enterprise features?",
            "What is the price of the annual plan compared to monthly?",
            "We are comparing vendors and need pricing for {seats} users.",
            "Is there a volume discount if we buy more licences?",
            "I would like to talk to someone about a partnership.",
            "How much would {seats} extra seats cost per month?",
        ),
    },
    "heldout": {
        "billing": (
            "Your system billed my card {amount} two times for the same order {order}.",
            "The invoice total does not match what I was charged.",
            "I see an unknown payment of {amount} on my card.",
            "I was billed for {month} although the subscription was cancelled.",
        ),
        "technical": (
            "Whenever I upload a file the app shows error {code} and crashes.",
            "The web dashboard shows a blank screen after the update.",
            "Every API request ends in a timeout error.",
            "Since the update the app is very slow and the export fails.",
        ),
        "shipping": (
            "The parcel with order {order} is still not delivered and tracking has not moved.",
            "The courier delivered a damaged box to the wrong address.",
            "My delivery came with the wrong item.",
            "Order {order} says delivered, but no package ever arrived.",
        ),
        "account": (
            "The password reset link never arrives, so my account stays locked.",
            "I need to update the email on my profile to {email} and reset two-factor.",
            "Please close my account and remove my profile.",
            "I think someone logged in to my account, my password no longer works.",
        ),
        "sales": (
            "Could you send pricing and a quote for {seats} licences?",
            "Our company wants a demo before we upgrade to the business plan.",
            "Is there a discount on the annual plan for {seats} users?",
            "We want to buy {seats} more seats, what would the price be?",
        ),
    },
}

# Another team's topic mentioned in passing: it must not decide the team.
DISTRACTORS = {
    "train": (
        "My last problem with {topic} was solved quickly, thanks for that.",
        "{Topic} is fine, that is not the issue.",
        "Not related, but {topic} works well.",
        "Last year you helped me with {topic}.",
        "You fixed {topic} for me before, thanks.",
        "No complaints about {topic}, by the way.",
    ),
    "heldout": (
        "The earlier issue with {topic} is already fixed.",
        "{Topic} works fine now, that was sorted out.",
    ),
}

# Training only: distractor sentences built from parts, "{lead}{topic}{tail}".
DISTRACTOR_LEADS = ("", "By the way, ", "Not related, but ", "Before that, ", "Also, ", "Last year ")
DISTRACTOR_TAILS = (" was solved quickly.", " is fine.", " works well.", " was fixed before.",
                    " is not the issue.", " got sorted out last time.", " has no problems.",
                    " is fine now, thanks.")

# Urgency cues: the phrase that sets the level (shared by both sets) inside a carrier sentence of the
# template set; training also uses whole sentences. No cue means "normal" (level 1).
URGENCY_KEYS = {
    0: ("no rush", "low priority", "whenever you have time", "it can wait"),
    1: ("this week", "in the next few days", "within a few days"),
    2: ("today", "as soon as possible", "urgent"),
    3: ("right now", "an emergency", "everything is down", "our whole team is blocked"),
}
URGENCY_CARRIERS = {
    "train": ("{Core}.", "This is {core}.", "Please note: {core}.", "Timing: {core}.", "{Core}, please.",
              "For us it is {core}."),
    "heldout": ("When? {Core}.", "About timing, {core}."),
}
URGENCY_CUES = {
    "train": {
        0: ("No rush on this.", "Whenever you have time.", "Just letting you know, low priority.",
            "It can wait, no rush.", "Low priority for us."),
        1: ("It would be good to sort this out this week.", "Please look at it in the next few days.",
            "This week would be fine.", "Within the next few days, please."),
        2: ("Please fix this today.", "This is urgent, I need it solved as soon as possible.",
            "Urgent: today if possible.", "I need it as soon as possible."),
        3: ("Right now our whole team is blocked!", "This is an emergency, everything is down for all our "
            "customers.", "Emergency, please help right now.", "Everything is down right now."),
    },
}

# Refund sentences: asked for now (True), or mentioned without asking (False). The clause that decides
# (shared by both sets) inside a carrier sentence of the template set; training also uses whole sentences.
REFUND_OBJECTS = ("a refund", "my money back", "a full refund", "a refund of {amount}")
REFUND_CLAUSES = {
    "ask": ("I want {obj}", "please give me {obj}", "I would like {obj}", "can I get {obj}", "I expect {obj}",
            "I am asking for {obj}"),
    "decline": ("I do not want {obj}", "I do not need {obj}", "I am not asking for {obj}",
                "no need for {obj}"),
    "past": ("I already got {obj} last month", "you sent me {obj} last time", "last year I received {obj}"),
}
REFUND_CARRIERS = {
    "train": ("{Core}.", "{Core}, thanks.", "To be honest, {core}.", "{Core}, just so you know.",
              "And {core}."),
    "heldout": ("One more thing: {core}.", "Oh, and {core}."),
}
REFUND = {
    "train": {
        "ask": ("I want a refund.", "Please refund the {amount}.", "Can I get my money back?",
                "I expect a full refund for this.", "Refund me, please.", "I would like my money back."),
        "decline": ("I do not need a refund, just fix it.", "No refund necessary.",
                    "I am not asking for a refund.", "I don't want my money back, I want it to work."),
        "past": ("Thanks for the refund you sent last month.", "The refund from last time arrived, thanks.",
                 "You already refunded me last week."),
    },
}

# Training only: neutral words put around a decisive phrase (a team key, an urgency cue, a refund clause)
# in place of a fixed carrier sentence, so that the model learns the phrase rather than its frame. No
# word here decides an answer (no topic, timing, refund, negation or "fixed"/"fine" word).
FRAME_WORDS = ("so", "well", "okay", "also", "hello", "look", "see", "here", "just", "quick", "question",
               "message", "note", "about", "on", "with", "for", "my", "our", "the", "this", "that", "it",
               "is", "we", "I", "you", "have", "got", "still", "really", "check", "case", "ticket", "thing",
               "point", "matter", "subject", "and", "then", "but", "some", "any", "write", "say", "tell",
               "ask", "need", "problem", "trouble", "odd", "strange", "weird", "help", "mean", "think")

# Sentences that say nothing about the answers (training only).
FILLERS = ("I have been a customer for years.", "My colleague asked me to write to you.",
           "I tried again this morning.", "This happens on my laptop and on my phone.",
           "I read your help page first.", "Our office is in Berlin.", "I hope you can help.")

# Training only: words for random question wordings, so that the model learns to answer from the
# question's type and options and the ticket, whatever the instructions and descriptions say.
NOISE_WORDS = ("please", "select", "value", "field", "decide", "best", "option", "for", "this", "which",
               "is", "of", "a", "here", "rate", "level", "pick", "what", "check", "flag", "result", "label",
               "output", "mark", "given", "input", "item", "case", "note", "kind", "type", "set", "use",
               "our", "form", "entry", "status", "step", "tag", "class", "group", "bucket", "scale", "yes",
               "no")

GREETINGS = {
    "train": ("Hi,", "Hello team,", "Dear support,", ""),
    "heldout": ("Good morning,", "Hey there,"),
}
CLOSINGS = {
    "train": ("Thanks, {name}", "Best regards, {name}", "Cheers", ""),
    "heldout": ("Kind regards, {name}", "Thank you in advance."),
}

# Question wordings. An instruction of None leaves it out (the encoder then uses the question id).
TEAM_QUESTION: dict[str, dict[str, Any]] = {
    "train": {
        "ids": ("team", "route_to", "department", "owner", "routing", "assigned_team"),
        "instructions": (
            "Which team should handle this ticket?",
            "Route `message` to the right team.",
            "Pick the department responsible for the customer's problem.",
            "Assign a team.",
            "Where should this ticket go?",
            "Choose the best team for this customer.",
            "Which group owns this?",
            None,
        ),
        "descriptions": {
            "billing": ("Payments, invoices, charges and refunds", "Invoices and card payments", None, None),
            "technical": ("Bugs, errors, outages and the app", "Software problems and errors", None, None),
            "shipping": ("Deliveries, parcels and couriers", "Orders in transit and returns", None, None),
            "account": ("Logins, passwords and profiles", "Access to the account", None, None),
            "sales": ("Quotes, pricing, plans and upgrades", "New purchases and discounts", None, None),
        },
    },
    "heldout": {
        "ids": ("assign_team", "queue"),
        "instructions": (
            "Which queue does this ticket belong in?",
            "Who should take care of this request?",
        ),
        "descriptions": {
            "billing": ("Anything about charges, payments or invoices", None),
            "technical": ("The app, the API and errors", None),
            "shipping": ("Parcels, couriers and delivery problems", None),
            "account": ("Passwords, login and account settings", None),
            "sales": ("Pricing, plans and buying more", None),
        },
    },
}
URGENCY_QUESTION: dict[str, dict[str, Any]] = {
    "train": {
        "ids": ("urgency", "priority", "urgency_level", "how_urgent"),
        "instructions": (
            "How urgent is this ticket?",
            "Rate the urgency of `message`.",
            "How quickly do we need to respond?",
            "Urgency of the request.",
            "How fast must we act?",
            None,
        ),
        "levels": (
            ("Can wait", "This week", "Today", "Right now"),
            ("low", "normal", "high", "critical"),
            ("No rush", "Within days", "Same day", "Immediately"),
            ("lowest", "lower", "higher", "highest"),
            (None, None, None, None),
        ),
    },
    "heldout": {
        "ids": ("severity",),
        "instructions": ("How soon must support act on this?",),
        "levels": (("minor", "moderate", "major", "severe"), ("trivial", "routine", "serious", "grave")),
    },
}
REFUND_QUESTION: dict[str, dict[str, Any]] = {
    "train": {
        "ids": ("refund", "wants_refund", "refund_asked", "money_back"),
        "instructions": ("Does the customer ask for a refund?", "Is a refund requested in `message`?",
                         "Refund requested?", "Does this ticket ask for money back?",
                         "Should we start a refund?", None),
        "criteria": (None, None,
                     {"true": "The customer asks for money back", "false": "No refund is requested"},
                     {"true": "Yes, refund"}, {"false": "No refund wanted"}),
    },
    "heldout": {
        "ids": ("refund_requested",),
        "instructions": ("Does the customer want their money back?",),
        "criteria": (None, {"true": "A refund is requested now"}),
    },
}

NAMES = ("Ana", "Ben", "Chen", "Dara", "Eli", "Fatima", "Goran", "Hana", "Ivan", "Jonas", "Kemi", "Lea",
         "Marco", "Nora", "Omar", "Priya", "Rosa", "Sam", "Tomas", "Yuki")
CHANNELS = ("email", "chat", "phone", "web_form", "twitter")
MONTHS = ("January", "March", "May", "July", "September", "November")
SUBJECTS = ("Help", "Problem", "Question", "Support request", "Issue with my order", "Urgent")


@dataclass(frozen=True)
class TriageExample:
    """One request and its correct answers: team label, urgency level index, refund asked."""

    request: dict[str, Any]
    team_question: str
    urgency_question: str
    refund_question: str
    team: str  # the label (as used in the request) of the right team
    urgency: int
    refund: bool

    @property
    def expected(self) -> dict[str, str | int | bool]:
        return {self.team_question: self.team, self.urgency_question: self.urgency,
                self.refund_question: self.refund}

    def target_index(self, question_id: str, option_ids: Sequence[str]) -> int:
        """Index of the right option among ``option_ids`` (the encoder's option order)."""
        value = self.expected[question_id]
        if isinstance(value, bool):
            return list(option_ids).index("true" if value else "false")
        return list(option_ids).index(str(value))


class TriageGenerator:
    """Examples from one template set. ``difficulty`` in [0, 1] (1 = the task as specified) scales how
    often the hard parts appear: distractor sentences and histories, greetings, second sentences, label
    aliases, partial label sets and extra labels. Lower values are for a training curriculum only."""

    def __init__(self, seed: int, templates: Templates = "train", difficulty: float = 1.0) -> None:
        if templates not in TEMPLATE_SETS:
            raise ValueError(f"templates must be one of {TEMPLATE_SETS}, got {templates!r}")
        self.rng = random.Random(f"triage/{templates}/{seed}")
        self.templates = templates
        self.difficulty = difficulty

    def _hard(self, probability: float) -> bool:
        return self.rng.random() < probability * self.difficulty

    def _fill(self, text: str, name: str) -> str:
        rng = self.rng
        return text.format(
            order=f"{rng.choice('ABCDKX')}-{rng.randint(100, 99999)}",
            amount=f"${rng.randint(5, 900)}.{rng.randint(0, 99):02d}",
            code=rng.choice(("500", "502", "403", "404", "E42", "X-17", "timeout")),
            seats=rng.choice((5, 10, 12, 25, 50, 100, 250)),
            month=rng.choice(MONTHS),
            email=f"{name.lower()}{rng.randint(1, 99)}@example.com",
            name=name,
        )

    def _wrapped(self, core: str) -> str:
        """``core`` between 0–4 random neutral words on each side, as a sentence (training only)."""
        rng = self.rng
        lead = rng.choices(FRAME_WORDS, k=rng.randint(0, 4))
        if lead and core[:2] != "I ":
            core = core[0].lower() + core[1:]
        words = [*lead, core.rstrip(".!?"), *rng.choices(FRAME_WORDS, k=rng.randint(0, 4))]
        text = " ".join(words)
        return text[0].upper() + text[1:] + rng.choice((".", ".", "!", "?"))

    def _framed(self, frames: Sequence[str], core: str, **slots: str) -> str:
        """``core`` in one of ``frames`` (slots ``{core}``/``{Core}``), or, in training, half the time in
        random neutral words instead."""
        if self.templates == "train" and self.rng.random() < 0.5:
            return self._wrapped(core)
        return self.rng.choice(frames).format(**{**slots, "core": core, "Core": core[0].upper() + core[1:]})

    def _issue(self, team: str, name: str) -> str:
        rng, t = self.rng, self.templates
        if rng.random() < (0.5 if t == "train" else 0.3):
            key = self._fill(rng.choice(TEAM_KEYS[team]), name)
            return self._framed(ISSUE_FRAMES[t], key)
        return self._fill(rng.choice(ISSUES[t][team]), name)

    def _message(self, team: str, cue_level: int | None, refund_kind: str | None, name: str) -> str:
        rng, t = self.rng, self.templates
        body = [self._issue(team, name)]
        if self._hard(0.2):  # a second sentence about the same problem
            body.append(self._issue(team, name))
        extra = []
        parts = t == "heldout" or rng.random() < 0.7  # compose cue sentences from parts
        if self._hard(0.45):
            other = rng.choice([x for x in TEAMS if x != team])
            topic = self._fill(rng.choice(TEAM_KEYS[other]), name)
            if parts and t == "train":
                lead = rng.choice(DISTRACTOR_LEADS)
                subject = topic if lead else topic[0].upper() + topic[1:]
                sentence = lead + subject + rng.choice(DISTRACTOR_TAILS)
                if rng.random() < 0.5:
                    sentence = self._wrapped(sentence)
            else:
                frame = rng.choice(DISTRACTORS[t])
                sentence = frame.format(topic=topic, Topic=topic[0].upper() + topic[1:])
            extra.append(sentence)
        if cue_level is not None:
            if parts:
                extra.append(self._framed(URGENCY_CARRIERS[t], rng.choice(URGENCY_KEYS[cue_level])))
            else:
                extra.append(rng.choice(URGENCY_CUES[t][cue_level]))
        if refund_kind is not None:
            if parts:
                clause = rng.choice(REFUND_CLAUSES[refund_kind]).format(obj=rng.choice(REFUND_OBJECTS))
                extra.append(self._fill(self._framed(REFUND_CARRIERS[t], clause), name))
            else:
                extra.append(self._fill(rng.choice(REFUND[t][refund_kind]), name))
        if t == "train" and self._hard(0.3):
            extra.append(rng.choice(FILLERS))
        if t == "train" and self._hard(0.2):
            extra.append(self._phrase())
        rng.shuffle(extra)
        # The problem usually comes first, but not always.
        middle = body + extra if rng.random() < 0.7 else extra[:1] + body + extra[1:]
        greeting = rng.choice(GREETINGS[t]) if self._hard(1.0) else ""
        closing = self._fill(rng.choice(CLOSINGS[t]), name) if self._hard(1.0) else ""
        return " ".join(x for x in (greeting, *middle, closing) if x)

    def _history(self, team: str) -> list[dict[str, str]]:
        rng = self.rng
        out = []
        for _ in range(rng.choice((1, 1, 2))):
            other = rng.choice(TEAMS)
            out.append({"team": other, "status": rng.choice(("closed", "resolved")),
                        "summary": self._fill(rng.choice(TEAM_KEYS[other]), "")})
        return out

    def _state(self, team: str, message: str, name: str, plan: str) -> Any:
        rng = self.rng
        channel = rng.choice(CHANNELS)
        layout = rng.randrange(4) if self._hard(1.0) else 0
        if self.templates == "train":
            if layout == 0:
                return {"channel": channel, "customer": {"name": name, "plan": plan}, "message": message}
            if layout == 1:
                return {"channel": channel,
                        "customer": {"plan": plan, "since": rng.randint(2015, 2026)},
                        "ticket": {"subject": rng.choice(SUBJECTS), "body": message}}
            if layout == 2:
                return {"history": self._history(team), "message": message, "plan": plan}
            return f"[{channel}] {plan} customer {name}: {message}"
        if layout == 0:
            return {"customer": {"name": name, "open_tickets": rng.randint(0, 3), "plan": plan},
                    "message": message, "source": channel}
        if layout == 1:
            return {"channel": channel, "customer": {"id": rng.randint(1000, 99999), "plan": plan},
                    "history": self._history(team), "message": message}
        if layout == 2:
            return {"ticket": {"body": message, "channel": channel, "customer_plan": plan}}
        return f"From {name} ({plan} plan) via {channel}:\n{message}"

    def example(self) -> TriageExample:
        rng, t = self.rng, self.templates
        team = rng.choice(TEAMS)
        name = rng.choice(NAMES)
        plan = rng.choices(PLANS, weights=(3, 4, 3))[0]
        cue_level = rng.choice((0, 1, 2, 3)) if rng.random() < 0.85 else None
        urgency = min(URGENCY_LEVELS - 1, (1 if cue_level is None else cue_level) + (plan == "enterprise"))
        roll = rng.random()
        refund_kind = "ask" if roll < 0.4 else "decline" if roll < 0.55 else "past" if roll < 0.65 else None
        message = self._message(team, cue_level, refund_kind, name)
        state = self._state(team, message, name, plan)

        spec = TEAM_QUESTION[t]
        others = [x for x in TEAMS if x != team]
        teams = [team, *rng.sample(others, rng.choice((3, 3, 4)) if self._hard(1.0) else 4)]
        extras = rng.sample(sorted(EXTRA_LABELS), rng.choice((0, 0, 0, 1)) if self._hard(1.0) else 0)
        criteria: dict[str, Any] = {}
        for x in teams:
            label = rng.choice(TEAM_LABELS[x]) if self._hard(1.0) else TEAM_LABELS[x][0]
            criteria[label] = rng.choice(spec["descriptions"][x])
        for x in extras:
            criteria[x] = rng.choice(EXTRA_LABELS[x])
        labels = list(criteria)
        rng.shuffle(labels)
        criteria = {label: criteria[label] for label in labels}
        team_label = next(label for label in labels if label in TEAM_LABELS[team])
        if self._noise():
            criteria = {label: self._phrase() if rng.random() < 0.5 else d for label, d in criteria.items()}
        team_question = self._question("choice", spec["instructions"], criteria)
        spec = URGENCY_QUESTION[t]
        levels = list(rng.choice(spec["levels"]))
        if self._noise():
            levels = [self._phrase() for _ in levels]
        urgency_question = self._question("score", spec["instructions"], levels)
        spec = REFUND_QUESTION[t]
        refund_criteria = rng.choice(spec["criteria"])
        if self._noise():
            keys = rng.choice((("true",), ("false",), ("true", "false")))
            refund_criteria = {key: self._phrase() for key in keys}
        refund_question = self._question(
            "noul", spec["instructions"], None if refund_criteria is None else dict(refund_criteria)
        )

        ids: dict[str, str] = {}
        pools = {"team": TEAM_QUESTION, "urgency": URGENCY_QUESTION, "refund": REFUND_QUESTION}
        for key, pool in pools.items():
            question_id = rng.choice(pool[t]["ids"])
            if self._noise():
                question_id = "_".join(rng.sample(NOISE_WORDS, 2))
            while question_id in ids.values():
                question_id = "_".join(rng.sample(NOISE_WORDS, 2))
            ids[key] = question_id
        questions = [(ids["team"], team_question), (ids["urgency"], urgency_question),
                     (ids["refund"], refund_question)]
        rng.shuffle(questions)
        request = {"model": "clef-demo", "state": state, "questions": dict(questions)}
        return TriageExample(request=request, team_question=ids["team"], urgency_question=ids["urgency"],
                             refund_question=ids["refund"], team=team_label, urgency=urgency,
                             refund=refund_kind == "ask")

    def _noise(self) -> bool:
        """Whether to replace a wording by random words (training templates only)."""
        return self.templates == "train" and self._hard(0.25)

    def _phrase(self) -> str:
        words = self.rng.choices(NOISE_WORDS, k=self.rng.randint(1, 4))
        return " ".join(words).capitalize() + self.rng.choice(("", ".", "?"))

    def _question(self, kind: str, instructions: Sequence[str | None], criteria: Any) -> dict[str, Any]:
        question: dict[str, Any] = {"type": kind}
        wording = self._phrase() if self._noise() else self.rng.choice(instructions)
        if wording is not None:
            question["instructions"] = wording
        if criteria is not None:
            question["criteria"] = criteria
        return question

    def examples(self, count: int) -> list[TriageExample]:
        return [self.example() for _ in range(count)]


def generate(count: int, seed: int, templates: Templates = "train") -> list[TriageExample]:
    """``count`` examples from the ``templates`` set, deterministic for ``seed``."""
    return TriageGenerator(seed, templates).examples(count)


@dataclass(frozen=True)
class TriageMetrics:
    choice_accuracy: float
    noul_accuracy: float  # at threshold 0.5
    score_mae: float  # |expected level index - right level|
    count: int

    def __str__(self) -> str:
        return (f"choice acc {self.choice_accuracy:.3f}, noul acc {self.noul_accuracy:.3f}, "
                f"score MAE {self.score_mae:.3f} (n={self.count})")


def evaluate(examples: Sequence[TriageExample], responses: Sequence[dict[str, Any]]) -> TriageMetrics:
    """Metrics of ``/v1/systemone`` response bodies against the examples' right answers."""
    choice = noul = 0
    error = 0.0
    for example, response in zip(examples, responses, strict=True):
        answers = response["answers"]
        choice += answers[example.team_question]["choice"] == example.team
        noul += (answers[example.refund_question]["noul"] >= 0.5) == example.refund
        error += abs(answers[example.urgency_question]["score"] - example.urgency)
    n = len(examples)
    return TriageMetrics(choice / n, noul / n, error / n, n)


def prompt_text(request: dict[str, Any]) -> str:
    """The whole record of ``request`` as the encoder lays it out, special tokens replaced by newlines.

    A tokenizer corpus: BPE merges then follow how often each word occurs in real records.
    """
    from clefserve.formats.clef.encoder import (
        FIELD_END,
        OPTIONS_HEADER,
        PREFIX,
        SCHEMA_HEADER,
        SUFFIX,
        question_options,
        render,
    )
    from clefserve.testing.tokenizer import SPECIAL_TOKENS

    parts = [PREFIX, render(request["state"]), SCHEMA_HEADER]
    for number, (question_id, question) in enumerate(request["questions"].items(), 1):
        parts.append(f"\nFIELD {number}\nID: {question_id}\nTYPE: {question['type']}\nINSTRUCTION: ")
        parts.append(render(question.get("instructions") or question_id))
        parts.append(OPTIONS_HEADER)
        for option_number, (option_id, description) in enumerate(question_options(question_id, question), 1):
            option = {"option_id": option_id} if description is None else {
                "option_id": option_id, "description": description}
            parts.append(f"OPTION {option_number}: {render(option)}\n")
        parts.append(FIELD_END)
    parts.append(SUFFIX)
    text = "".join(parts)
    for token in SPECIAL_TOKENS:
        text = text.replace(token, "\n")
    return text
