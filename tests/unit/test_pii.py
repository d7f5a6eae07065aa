"""The PII stage, run on the real Presidio recognizers (no mocks): what is replaced, what quarantines.

Every planted value is realistic: card numbers pass Luhn, IBANs pass their mod-97 check, SSNs are not the
sample numbers Presidio rejects on purpose. The helpers below prove that, so a test cannot pass because the
recognizer ignored an invalid value.
"""

from __future__ import annotations

import itertools
import re
import socket
from collections.abc import Iterator
from typing import Any

import pytest

from ibex_dataplane.pii import PiiConfigurationError, PiiError
from ibex_dataplane.pii.redactor import (
    DEFAULT_PATTERN_ENTITIES,
    PiiRedactor,
    QuarantineKind,
    QuarantineReason,
    RedactionResult,
    _Candidate,
    _resolve_overlaps,
)


def _luhn_valid(number: str) -> bool:
    digits = [int(d) for d in re.sub(r"\D", "", number)][::-1]
    total = sum(d if i % 2 == 0 else (d * 2 - 9 if d * 2 > 9 else d * 2) for i, d in enumerate(digits))
    return total % 10 == 0


def _iban_valid(iban: str) -> bool:
    compact = iban.replace(" ", "")
    rearranged = compact[4:] + compact[:4]
    return int("".join(str(int(ch, 36)) for ch in rearranged)) % 97 == 1


VISA = "4539 1488 0343 6467"
MASTERCARD = "5425-2334-3010-9903"
MASTERCARD_COMPACT = "5555555555554444"
IBAN_DE = "DE89 3704 0044 0532 0130 00"
IBAN_GB = "GB33BUKB20201555555555"

# (sentence, planted raw values, placeholder expected in the redacted text)
PLANTED = [
    ("Send the contract to jane.doe@example.co.uk before Friday.", ["jane.doe@example.co.uk"], "[EMAIL_ADDRESS]"),
    (
        "Her work address is m.okafor+billing@northwind-traders.com",
        ["m.okafor+billing@northwind-traders.com"],
        "[EMAIL_ADDRESS]",
    ),
    ("Call Priya on 415-555-0132 after six.", ["415-555-0132"], "[PHONE_NUMBER]"),
    ("My phone number is (646) 555-0178.", ["(646) 555-0178", "555-0178"], "[PHONE_NUMBER]"),
    ("Mobile: +1 212 555 0147", ["+1 212 555 0147", "212 555 0147"], "[PHONE_NUMBER]"),
    ("The London office phone is +44 20 7946 0958.", ["+44 20 7946 0958", "7946 0958"], "[PHONE_NUMBER]"),
    ("Reach Jonas on his mobile +49 1512 3456789 in Berlin.", ["+49 1512 3456789", "3456789"], "[PHONE_NUMBER]"),
    ("Paris desk, call +33 1 42 68 53 00 in the morning.", ["+33 1 42 68 53 00", "42 68 53 00"], "[PHONE_NUMBER]"),
    ("His cell is +91 98765 43210 while he travels.", ["+91 98765 43210", "98765 43210"], "[PHONE_NUMBER]"),
    (f"Pay with the Visa card {VISA}, expiry 09/27.", [VISA, VISA.replace(" ", "")], "[CREDIT_CARD]"),
    (f"The backup Mastercard is {MASTERCARD}.", [MASTERCARD, MASTERCARD.replace("-", "")], "[CREDIT_CARD]"),
    (f"Charge {MASTERCARD_COMPACT} for the renewal.", [MASTERCARD_COMPACT], "[CREDIT_CARD]"),
    (f"Salary goes to IBAN {IBAN_DE} every month.", [IBAN_DE, IBAN_DE.replace(" ", "")], "[IBAN_CODE]"),
    (f"Refunds go to {IBAN_GB} (Barclays).", [IBAN_GB], "[IBAN_CODE]"),
    ("Her SSN is 457-55-5462.", ["457-55-5462", "457555462"], "[US_SSN]"),
    ("Social security number: 212 67 8391", ["212 67 8391"], "[US_SSN]"),
]

CLEAN = [
    "The user prefers window seats, drinks oat-milk flat whites and writes Python 3.11 with numpy 2.4.",
    "Deploys happen on Tuesdays at 14:00 UTC; see https://docs.python.org/3/library/asyncio.html first.",
    "Order 12345678 shipped on 2024-03-05; ticket ABC123456 was reopened.",
    "Build 20240305 of version 1.2.3 fixed 42 bugs across 7 services in us-east-1.",
    "Quarterly revenue grew 8% to $1,250,000; headcount is 37.",
    "Meeting moved to 03/05/2025 in room 4B; bring the Q3 report.",
    "",
]


@pytest.fixture(scope="module")
def redactor() -> Iterator[PiiRedactor]:
    with PiiRedactor() as instance:
        yield instance


def test_planted_values_are_valid_so_the_tests_mean_something() -> None:
    assert all(_luhn_valid(card) for card in (VISA, MASTERCARD, MASTERCARD_COMPACT))
    assert all(_iban_valid(iban) for iban in (IBAN_DE, IBAN_GB))


@pytest.mark.parametrize(("sentence", "raw_values", "placeholder"), PLANTED)
def test_planted_pii_is_replaced_by_a_typed_placeholder_and_never_survives(
    redactor: PiiRedactor, sentence: str, raw_values: list[str], placeholder: str
) -> None:
    result = redactor.redact(sentence)
    for raw in raw_values:
        assert raw not in result.text
        assert raw not in repr(result)
    assert placeholder in result.text
    assert {finding.entity_type for finding in result.findings} == {placeholder.strip("[]")}
    assert all(finding.redacted and finding.score >= redactor.threshold for finding in result.findings)
    assert not result.quarantine
    assert result.quarantine_reasons == ()


def test_a_memory_with_many_kinds_of_pii_is_redacted_in_place(redactor: PiiRedactor) -> None:
    memory = (
        "Vendor contact alex.morgan@northwind-traders.com, phone +1 415 555 0132. "
        f"Pay invoice 7781 by card {VISA} or to IBAN {IBAN_DE}; tax id (SSN) 457-55-5462."
    )
    result = redactor.redact(memory)
    assert result.text == (
        "Vendor contact [EMAIL_ADDRESS], phone [PHONE_NUMBER]. "
        "Pay invoice 7781 by card [CREDIT_CARD] or to IBAN [IBAN_CODE]; tax id (SSN) [US_SSN]."
    )
    assert [f.entity_type for f in result.findings] == [
        "EMAIL_ADDRESS",
        "PHONE_NUMBER",
        "CREDIT_CARD",
        "IBAN_CODE",
        "US_SSN",
    ]
    # Offsets point into the original text, in order, without overlaps.
    spans = [(f.start, f.end) for f in result.findings]
    assert spans == sorted(spans)
    assert all(end <= next_start for (_, end), (next_start, _) in itertools.pairwise(spans))
    assert memory[spans[0][0] : spans[0][1]] == "alex.morgan@northwind-traders.com"
    assert not result.quarantine


@pytest.mark.parametrize("text", CLEAN)
def test_clean_text_is_unchanged_and_not_quarantined(redactor: PiiRedactor, text: str) -> None:
    result = redactor.redact(text)
    assert result.text == text
    assert result.findings == ()
    assert not result.quarantine


def test_a_disallowed_type_quarantines_the_record_even_when_redacted(redactor: PiiRedactor) -> None:
    result = redactor.redact(
        "Send the contract to jane.doe@example.co.uk before Friday.",
        disallowed_types=frozenset({"EMAIL_ADDRESS", "CREDIT_CARD"}),
    )
    assert result.text == "Send the contract to [EMAIL_ADDRESS] before Friday."
    assert result.quarantine
    assert result.quarantine_reasons == (QuarantineReason(QuarantineKind.DISALLOWED_TYPE, "EMAIL_ADDRESS"),)


def test_a_disallowed_type_that_is_absent_changes_nothing(redactor: PiiRedactor) -> None:
    result = redactor.redact("Call Priya on 415-555-0132 after six.", disallowed_types=frozenset({"US_SSN"}))
    assert result.text == "Call Priya on [PHONE_NUMBER] after six."
    assert not result.quarantine


def test_a_plausible_finding_below_the_threshold_quarantines_without_replacing(redactor: PiiRedactor) -> None:
    # A valid phone number with no word around it that says so: Presidio scores it 0.40.
    text = "Reach Dana on 415-555-0132 tomorrow."
    result = redactor.redact(text)
    assert result.text == text  # kept as written for the reviewer; quarantined records are never retrieved
    (finding,) = result.findings
    assert finding.entity_type == "PHONE_NUMBER"
    assert redactor.plausibility_floor <= finding.score < redactor.threshold
    assert not finding.redacted
    assert result.quarantine
    assert result.quarantine_reasons == (QuarantineReason(QuarantineKind.LOW_CONFIDENCE, "PHONE_NUMBER"),)


def test_a_low_confidence_disallowed_finding_gives_both_reasons(redactor: PiiRedactor) -> None:
    result = redactor.redact("Reach Dana on 415-555-0132 tomorrow.", disallowed_types=frozenset({"PHONE_NUMBER"}))
    assert result.quarantine_reasons == (
        QuarantineReason(QuarantineKind.DISALLOWED_TYPE, "PHONE_NUMBER"),
        QuarantineReason(QuarantineKind.LOW_CONFIDENCE, "PHONE_NUMBER"),
    )


def test_the_repr_of_a_result_leaves_out_the_text(redactor: PiiRedactor) -> None:
    result = redactor.redact("Reach Dana on 415-555-0132 tomorrow.")
    assert "415" not in repr(result)
    assert "Dana" not in repr(result)
    assert "PHONE_NUMBER" in repr(result)


def test_fragments_inside_a_stronger_finding_are_not_reported() -> None:
    # With URL detection on, the e-mail address also matches as two URLs ("jane.do" and "example.co.uk",
    # scored 0.5). They must neither be reported nor quarantine the record.
    with PiiRedactor(entities=DEFAULT_PATTERN_ENTITIES | {"URL"}) as with_urls:
        result = with_urls.redact("Contact jane.doe@example.co.uk today.")
    assert result.text == "Contact [EMAIL_ADDRESS] today."
    assert [f.entity_type for f in result.findings] == ["EMAIL_ADDRESS"]
    assert not result.quarantine


def test_a_confident_finding_that_loses_an_overlap_still_gets_covered() -> None:
    winner = _Candidate("CREDIT_CARD", 10, 29, 1.0)
    partly_outside = _Candidate("PHONE_NUMBER", 20, 35, 0.75)
    weak_neighbour = _Candidate("US_BANK_NUMBER", 30, 40, 0.4)
    kept, spans = _resolve_overlaps([weak_neighbour, partly_outside, winner], threshold=0.7)
    assert kept == [winner, weak_neighbour]
    assert [(s.entity_type, s.start, s.end) for s in spans] == [("CREDIT_CARD", 10, 35)]


async def test_redact_async_gives_the_same_result_as_redact(redactor: PiiRedactor) -> None:
    text = f"Send the contract to jane.doe@example.co.uk; card {VISA}."
    assert await redactor.redact_async(text) == redactor.redact(text)


def test_building_and_using_the_redactor_never_touches_the_network(monkeypatch: pytest.MonkeyPatch) -> None:
    attempts: list[str] = []
    real_getaddrinfo = socket.getaddrinfo
    real_connect = socket.socket.connect

    def recording_getaddrinfo(host: Any, *args: Any, **kwargs: Any) -> Any:
        attempts.append(f"resolve {host}")
        return real_getaddrinfo(host, *args, **kwargs)

    def recording_connect(self: socket.socket, address: Any) -> None:
        attempts.append(f"connect {address}")
        real_connect(self, address)

    monkeypatch.setattr(socket, "getaddrinfo", recording_getaddrinfo)
    monkeypatch.setattr(socket.socket, "connect", recording_connect)
    with PiiRedactor() as fresh:
        result = fresh.redact("Mail ops@unusual-tld-check.co.jp or ops@example.museum now.")
    assert result.text == "Mail [EMAIL_ADDRESS] or [EMAIL_ADDRESS] now."
    assert attempts == []


def test_asking_for_a_type_no_recognizer_detects_fails_at_construction() -> None:
    with pytest.raises(PiiConfigurationError, match="PERSON"):
        PiiRedactor(entities={"EMAIL_ADDRESS", "PERSON"})  # PERSON needs the optional NER model


def test_enabling_ner_without_its_model_package_fails_clearly() -> None:
    with pytest.raises(PiiConfigurationError, match="not installed"):
        PiiRedactor(enable_ner=True, ner_model_package="ibex_test_no_such_spacy_model")


def test_thresholds_must_be_ordered() -> None:
    with pytest.raises(PiiConfigurationError):
        PiiRedactor(threshold=0.3, plausibility_floor=0.5)


async def test_a_closed_redactor_refuses_work() -> None:
    closed = PiiRedactor()
    closed.close()
    with pytest.raises(PiiError):
        closed.redact("anything")
    with pytest.raises(PiiError):
        await closed.redact_async("anything")


def test_results_are_immutable(redactor: PiiRedactor) -> None:
    result: RedactionResult = redactor.redact("Call Priya on 415-555-0132 after six.")
    with pytest.raises(AttributeError):
        result.text = "changed"  # type: ignore[misc]


@pytest.mark.parametrize("number", [1640, 1652, 1669])
def test_four_digit_amounts_and_years_are_not_phone_numbers(redactor: PiiRedactor, number: int) -> None:
    for text in (f"We paid {number} dollars for the bikes.", f"The painting dates from {number}, we paid {number}."):
        result = redactor.redact(text)
        assert result.text == text
        assert not result.quarantine, text
        assert [f.entity_type for f in result.findings] == []


def test_a_real_phone_number_is_still_caught_next_to_a_four_digit_one(redactor: PiiRedactor) -> None:
    result = redactor.redact("We paid 1640 dollars; call me at +44 20 7946 0958 about it.")
    assert result.text == "We paid 1640 dollars; call me at [PHONE_NUMBER] about it."


PROSE_WITHOUT_PATTERNS = [
    "Caroline: I went to a support group yesterday and it was so powerful.",
    "Melanie: That's great! Painting by the lake is my favourite way to unwind - face-to-face with nature.",
    "The user prefers window seats and oat-milk flat whites; she dislikes early flights.",
    "Decade-old bead-work, cafe-bed and dead-beef stew",
]


@pytest.fixture(scope="module")
def thorough() -> Iterator[PiiRedactor]:
    # URL is not one of the pattern entities the shortcut was written for, so this redactor always analyzes.
    with PiiRedactor(entities=[*sorted(DEFAULT_PATTERN_ENTITIES), "URL"]) as r:
        yield r


@pytest.mark.parametrize("text", PROSE_WITHOUT_PATTERNS)
def test_text_the_shortcut_skips_is_text_the_analyzer_finds_nothing_in(
    redactor: PiiRedactor, thorough: PiiRedactor, text: str
) -> None:
    assert thorough.redact(text).findings == ()
    assert redactor.redact(text).text == text
    assert redactor.redact(text).findings == ()


def test_the_shortcut_never_skips_text_a_pattern_could_match(redactor: PiiRedactor) -> None:
    may_match = ("a@b", "ipv6 ::ffff", "fe80::", "mac aa:bb:cc:dd:ee:ff", "aa-bb-cc-dd-ee-ff", "abcd.efab.cdef", "7")
    for text in may_match:
        assert redactor.might_find(text), text
    assert not redactor.might_find(PROSE_WITHOUT_PATTERNS[0])
    assert redactor.redact("Ops: write to ops@example.org.").text == "Ops: write to [EMAIL_ADDRESS]."
    router = redactor.redact("Ops: the router is fe80::1ff:fe23:4567:890a.")
    assert {f.entity_type for f in router.findings} == {"IP_ADDRESS"}


def test_a_redactor_looking_for_more_than_the_pattern_entities_analyzes_everything(thorough: PiiRedactor) -> None:
    assert thorough.might_find(PROSE_WITHOUT_PATTERNS[0])
