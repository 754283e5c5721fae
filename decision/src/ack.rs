//! Composing the acknowledgement spoken while the calls run from the tools' waiting
//! hints: `["looking up your upcoming appointments", "checking your billing"]` becomes
//! "Sure, I'll look up your upcoming appointments and check your billing."

use std::collections::HashSet;

/// What to say when no hint is usable.
const NO_HINT_ACK: &str = "Sure, one moment.";

/// Composes one sentence from the waiting hints of a decision's tools, in order.
///
/// Hints are gerund phrases ("checking your billing"); each is turned into its base
/// form with [`base_form`]. Blank hints are ignored, a trailing period is dropped, and
/// hints that are the same apart from case and surrounding whitespace are said once.
/// Without any usable hint the answer is "Sure, one moment."
pub fn compose_acknowledgement(hints: &[&str]) -> String {
    let mut seen = HashSet::new();
    let mut phrases: Vec<String> = Vec::new();
    for hint in hints {
        let hint = hint.trim().trim_end_matches('.').trim_end();
        if hint.is_empty() {
            continue;
        }
        let phrase = lowercase_initial(&base_form(hint));
        if seen.insert(phrase.to_lowercase()) {
            phrases.push(phrase);
        }
    }
    match phrases.as_slice() {
        [] => NO_HINT_ACK.to_string(),
        [only] => format!("Sure, I'll {only}."),
        [init @ .., last] => format!("Sure, I'll {} and {last}.", init.join(", ")),
    }
}

/// Turns a gerund phrase into its base form: "looking up your upcoming appointments"
/// becomes "look up your upcoming appointments".
///
/// Only the first word is changed, and only when it ends in "ing"; the rest of the
/// phrase is kept verbatim, as is the case of the first letter.
pub fn base_form(gerund_phrase: &str) -> String {
    let phrase = gerund_phrase.trim_start();
    let word_end = phrase.find(char::is_whitespace).unwrap_or(phrase.len());
    let (word, rest) = phrase.split_at(word_end);
    let letters_end = word
        .char_indices()
        .rev()
        .find(|(_, c)| c.is_alphabetic())
        .map_or(0, |(i, c)| i + c.len_utf8());
    let (letters, trailing) = word.split_at(letters_end);
    match verb_base(letters) {
        Some(base) => format!("{base}{trailing}{rest}"),
        None => phrase.to_string(),
    }
}

/// The base form of a gerund, in the gerund's case; `None` when `word` is not one.
fn verb_base(word: &str) -> Option<String> {
    let lower = word.to_lowercase();
    let base = gerund_base(&lower)?;
    Some(match_case(word, base))
}

/// The base form of a lowercase gerund.
fn gerund_base(gerund: &str) -> Option<String> {
    if let Some((head, tail)) = gerund.rsplit_once('-') {
        return gerund_base(tail).map(|base| format!("{head}-{base}"));
    }
    if let Some((_, base)) = IRREGULAR.iter().find(|(g, _)| *g == gerund) {
        return Some((*base).to_string());
    }
    if NOT_GERUNDS.contains(&gerund) {
        return None;
    }
    let stem = gerund.strip_suffix("ing")?;
    if !stem.chars().any(|c| is_vowel(c) || c == 'y') {
        // "bring", "string", "thing": not a verb plus "ing".
        return None;
    }
    if let Some(base) = undouble(stem) {
        return Some(base);
    }
    if needs_final_e(stem) {
        return Some(format!("{stem}e"));
    }
    Some(stem.to_string())
}

/// Stems ending in a doubled consonant: "gett" → "get", "pull" → "pull".
/// `None` when the stem does not end in a doubled consonant.
fn undouble(stem: &str) -> Option<String> {
    let mut rev = stem.chars().rev();
    let (last, before) = (rev.next()?, rev.next()?);
    if last != before || !is_consonant(last) {
        return None;
    }
    if KEEP_DOUBLE.contains(&stem) {
        return Some(stem.to_string());
    }
    let keeps = matches!(last, 'l' | 's' | 'z' | 'f') && !UNDOUBLE_ANYWAY.contains(&stem);
    if keeps {
        return Some(stem.to_string());
    }
    let mut base = stem.to_string();
    base.pop();
    Some(base)
}

/// Whether the base form of `stem` (a gerund without "ing") ends in a silent "e".
fn needs_final_e(stem: &str) -> bool {
    if E_VERBS.binary_search(&format!("{stem}e").as_str()).is_ok() {
        return true;
    }
    if NO_FINAL_E.contains(&stem) {
        return false;
    }
    let mut rev = stem.chars().rev();
    let Some(c1) = rev.next() else {
        return false;
    };
    let c2 = rev.next();
    let c3 = rev.next();
    let consonant = |c: Option<char>| c.is_some_and(is_consonant);
    match (c1, c2) {
        // English words do not end in "v" or "u": "sav(e)", "queu(e)".
        ('v' | 'u', _) => true,
        // "siz(e)", "freez(e)", "analyz(e)".
        ('z', Some(c)) => c != 'z',
        // "plac(e)", "reduc(e)", "announc(e)".
        ('c', _) => true,
        // "pars(e)", "clos(e)", "releas(e)", "analys(e)"; not "miss", "focus".
        ('s', Some(c)) => c != 's' && c != 'u',
        // "judg(e)", "merg(e)", "indulg(e)", "manag(e)", "gaug(e)"; not "hang".
        ('g', Some('d' | 'r' | 'l')) => true,
        ('g', Some('a')) => consonant(c3),
        ('g', Some('u')) => c3 == Some('a'),
        // "handl(e)", "cycl(e)", "schedul(e)", "rul(e)"; not "crawl", "curl", "pull".
        ('l', Some('u')) => consonant(c3),
        ('l', Some(c)) => is_consonant(c) && !matches!(c, 'l' | 'r' | 'w'),
        // "measur(e)", "shar(e)", "hir(e)"; not "pour", "clear", "pair".
        ('r', Some('u')) => c3 != Some('o'),
        ('r', Some('a' | 'i')) => consonant(c3),
        // "validat(e)", "negotiat(e)", "evaluat(e)"; not "eat", "float".
        ('t', Some('a')) => consonant(c3) || matches!(c3, Some('i' | 'u')),
        // "decid(e)", "cod(e)", "includ(e)", "trad(e)"; not "load", "need".
        ('d', Some('a' | 'i' | 'o' | 'u')) => consonant(c3),
        // "combin(e)", "tun(e)"; not "join", "open".
        ('n', Some('i' | 'u')) => consonant(c3),
        // "nam(e)", "tim(e)", "assum(e)"; not "claim", "form".
        ('m', Some('a' | 'i' | 'u')) => consonant(c3),
        // "mak(e)", "lik(e)", "invok(e)"; not "look", "speak", "check".
        ('k', Some('a' | 'i' | 'o' | 'u')) => consonant(c3),
        // "describ(e)", "prob(e)", "tub(e)"; not "climb".
        ('b', Some('i' | 'o' | 'u')) => consonant(c3),
        _ => false,
    }
}

fn is_vowel(c: char) -> bool {
    matches!(c, 'a' | 'e' | 'i' | 'o' | 'u')
}

fn is_consonant(c: char) -> bool {
    c.is_alphabetic() && !is_vowel(c)
}

/// `base` with the case of `original`: all capitals, a capital initial, or lowercase.
fn match_case(original: &str, base: String) -> String {
    let has_letters = original
        .chars()
        .filter(|c| c.is_alphabetic())
        .nth(1)
        .is_some();
    if has_letters && !original.chars().any(char::is_lowercase) {
        return base.to_uppercase();
    }
    if original.chars().next().is_some_and(char::is_uppercase) {
        return capitalize(&base);
    }
    base
}

fn capitalize(s: &str) -> String {
    let mut chars = s.chars();
    match chars.next() {
        Some(first) => first.to_uppercase().chain(chars).collect(),
        None => String::new(),
    }
}

/// Lowercases a capitalized first word ("Look" → "look"), leaving acronyms ("SMS") and
/// lowercase text alone.
fn lowercase_initial(s: &str) -> String {
    let mut letters = s.chars().filter(|c| c.is_alphabetic());
    let capitalized = letters.next().is_some_and(char::is_uppercase)
        && !letters.next().is_some_and(char::is_uppercase);
    if !capitalized {
        return s.to_string();
    }
    let mut chars = s.chars();
    match chars.next() {
        Some(first) => first.to_lowercase().chain(chars).collect(),
        None => String::new(),
    }
}

/// Gerunds whose base form no rule produces.
const IRREGULAR: &[(&str, &str)] = &[
    ("belying", "belie"),
    ("dying", "die"),
    ("frolicking", "frolic"),
    ("lying", "lie"),
    ("mimicking", "mimic"),
    ("panicking", "panic"),
    ("picnicking", "picnic"),
    ("trafficking", "traffic"),
    ("tying", "tie"),
    ("untying", "untie"),
    ("vying", "vie"),
];

/// Words ending in "ing" that are not a verb's gerund.
const NOT_GERUNDS: &[&str] = &[
    "anything",
    "ceiling",
    "during",
    "evening",
    "everything",
    "incoming",
    "morning",
    "nothing",
    "ongoing",
    "outgoing",
    "something",
    "upcoming",
];

/// Verbs whose base form ends in a doubled consonant that is usually undoubled.
const KEEP_DOUBLE: &[&str] = &["add", "ebb", "egg", "err", "inn", "purr", "whirr"];

/// Stems doubling "l", "s" or "z" only before "ing" (British "cancelling").
const UNDOUBLE_ANYWAY: &[&str] = &[
    "annull", "biass", "buss", "cancell", "channell", "compell", "controll", "counsell", "diall",
    "dispell", "excell", "expell", "focuss", "fuell", "gass", "labell", "levell", "marvell",
    "modell", "patroll", "propell", "quarrell", "quizz", "rebell", "repell", "signall", "totall",
    "travell",
];

/// Stems the final-"e" rules would get wrong.
const NO_FINAL_E: &[&str] = &[
    "alias", "arc", "async", "atlas", "bias", "canvas", "combat", "diagram", "disc", "gas",
    "kayak", "program", "resync", "spec", "sync", "zinc",
];

/// Common verbs ending in a silent "e", sorted (searched with `binary_search`).
const E_VERBS: &[&str] = &[
    "abuse",
    "accuse",
    "acquire",
    "actuate",
    "adore",
    "age",
    "amuse",
    "analyse",
    "analyze",
    "arrange",
    "atone",
    "attribute",
    "avenge",
    "bathe",
    "become",
    "binge",
    "breathe",
    "calculate",
    "cause",
    "challenge",
    "change",
    "choose",
    "cite",
    "clone",
    "close",
    "clothe",
    "combine",
    "come",
    "commute",
    "compare",
    "compete",
    "compile",
    "complete",
    "compose",
    "compute",
    "condone",
    "confuse",
    "console",
    "contribute",
    "cope",
    "create",
    "cringe",
    "define",
    "delete",
    "deplete",
    "determine",
    "devote",
    "diffuse",
    "dispute",
    "dissuade",
    "distribute",
    "dupe",
    "elope",
    "enquire",
    "escape",
    "evaluate",
    "examine",
    "exchange",
    "excite",
    "excuse",
    "execute",
    "exhale",
    "expedite",
    "explore",
    "expunge",
    "figure",
    "file",
    "fluctuate",
    "fringe",
    "fuse",
    "gauge",
    "generate",
    "give",
    "graduate",
    "gripe",
    "guide",
    "handle",
    "have",
    "hinge",
    "hope",
    "ignite",
    "ignore",
    "implore",
    "incite",
    "infringe",
    "infuse",
    "inhale",
    "inquire",
    "invite",
    "loathe",
    "locate",
    "lunge",
    "make",
    "manage",
    "measure",
    "misuse",
    "move",
    "mute",
    "note",
    "oblige",
    "organize",
    "outline",
    "overcome",
    "paste",
    "pause",
    "persuade",
    "peruse",
    "phone",
    "pile",
    "pipe",
    "place",
    "plunge",
    "pollute",
    "postpone",
    "prepare",
    "price",
    "profile",
    "promote",
    "provide",
    "punctuate",
    "quote",
    "range",
    "rearrange",
    "recite",
    "recompile",
    "recompute",
    "reconcile",
    "recreate",
    "refuse",
    "refute",
    "remove",
    "require",
    "reroute",
    "reserve",
    "reshape",
    "restore",
    "retrieve",
    "retype",
    "reuse",
    "revenge",
    "rewrite",
    "rope",
    "route",
    "salute",
    "save",
    "scale",
    "schedule",
    "scope",
    "score",
    "scrape",
    "seethe",
    "shape",
    "share",
    "singe",
    "situate",
    "smile",
    "snipe",
    "snore",
    "soothe",
    "source",
    "sponge",
    "store",
    "stripe",
    "substitute",
    "summarize",
    "swipe",
    "take",
    "tape",
    "taste",
    "teethe",
    "tile",
    "type",
    "unite",
    "update",
    "use",
    "validate",
    "vote",
    "waste",
    "welcome",
    "while",
    "wipe",
    "write",
    "zone",
];

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_design_example() {
        assert_eq!(
            compose_acknowledgement(&[
                "looking up your upcoming appointments",
                "checking your billing"
            ]),
            "Sure, I'll look up your upcoming appointments and check your billing."
        );
    }

    #[test]
    fn one_and_many_hints() {
        assert_eq!(
            compose_acknowledgement(&["checking your billing"]),
            "Sure, I'll check your billing."
        );
        assert_eq!(
            compose_acknowledgement(&[
                "checking your billing",
                "pulling your orders",
                "getting the weather"
            ]),
            "Sure, I'll check your billing, pull your orders and get the weather."
        );
        assert_eq!(
            compose_acknowledgement(&["making a plan", "saving it", "using it", "sending it"]),
            "Sure, I'll make a plan, save it, use it and send it."
        );
    }

    #[test]
    fn blank_duplicate_and_missing_hints() {
        assert_eq!(compose_acknowledgement(&[]), "Sure, one moment.");
        assert_eq!(
            compose_acknowledgement(&["", "   ", "."]),
            "Sure, one moment."
        );
        assert_eq!(
            compose_acknowledgement(&[
                "checking your billing",
                "  Checking your billing. ",
                "",
                "CHECKING YOUR BILLING"
            ]),
            "Sure, I'll check your billing."
        );
        assert_eq!(
            compose_acknowledgement(&["checking your billing.", "running the numbers..."]),
            "Sure, I'll check your billing and run the numbers."
        );
    }

    #[test]
    fn capitalized_hints_read_as_one_sentence() {
        assert_eq!(
            compose_acknowledgement(&["Looking up your order", "SMS-ing you a link"]),
            "Sure, I'll look up your order and SMS-ing you a link."
        );
        assert_eq!(base_form("Looking up your order"), "Look up your order");
    }

    #[test]
    fn only_the_first_word_changes() {
        assert_eq!(
            base_form("looking up your upcoming appointments"),
            "look up your upcoming appointments"
        );
        assert_eq!(
            base_form("checking   the  billing  thing"),
            "check   the  billing  thing"
        );
        assert_eq!(base_form("check your billing"), "check your billing");
        assert_eq!(base_form("one moment"), "one moment");
        assert_eq!(base_form("bringing it"), "bring it");
        assert_eq!(base_form("bring it"), "bring it");
        assert_eq!(base_form("string theory"), "string theory");
        assert_eq!(base_form("checking, then calling"), "check, then calling");
        assert_eq!(base_form(""), "");
        assert_eq!(base_form("ing"), "ing");
        assert_eq!(base_form("double-checking that"), "double-check that");
        assert_eq!(base_form("re-creating it"), "re-create it");
    }

    #[test]
    fn doubled_consonants() {
        for (gerund, base) in [
            ("getting", "get"),
            ("running", "run"),
            ("planning", "plan"),
            ("shipping", "ship"),
            ("logging", "log"),
            ("submitting", "submit"),
            ("chatting", "chat"),
            ("pulling", "pull"),
            ("calling", "call"),
            ("missing", "miss"),
            ("processing", "process"),
            ("buzzing", "buzz"),
            ("stuffing", "stuff"),
            ("adding", "add"),
            ("cancelling", "cancel"),
            ("controlling", "control"),
        ] {
            assert_eq!(base_form(gerund), base, "{gerund}");
        }
    }

    #[test]
    fn silent_e_table_and_rules() {
        for base in [
            "make",
            "take",
            "prepare",
            "create",
            "update",
            "compute",
            "save",
            "close",
            "retrieve",
            "compile",
            "write",
            "use",
            "handle",
            "arrange",
            "schedule",
            "validate",
            "calculate",
            "manage",
            "organize",
            "generate",
            "locate",
            "place",
            "price",
            "quote",
            "reserve",
            "share",
            "source",
            "store",
            "have",
            "give",
            "move",
            "remove",
            "provide",
            "compare",
            "combine",
            "figure",
            "examine",
            "determine",
            "gauge",
            "measure",
            "analyze",
            "summarize",
            "evaluate",
            "negotiate",
            "browse",
            "parse",
            "change",
            "judge",
            "merge",
            "continue",
            "queue",
            "describe",
            "decide",
            "include",
            "name",
            "time",
            "invoke",
            "like",
            "tune",
            "define",
            "require",
            "guide",
            "cycle",
            "rule",
            "file",
            "see",
            "agree",
        ] {
            let gerund = if let Some(stem) = base.strip_suffix('e').filter(|s| !s.ends_with('e')) {
                format!("{stem}ing")
            } else {
                format!("{base}ing")
            };
            assert_eq!(base_form(&gerund), base, "{gerund}");
        }
    }

    #[test]
    fn no_silent_e_where_there_is_none() {
        for base in [
            "look", "check", "review", "search", "fetch", "find", "read", "load", "visit", "edit",
            "wait", "eat", "open", "join", "explain", "claim", "form", "speak", "book", "climb",
            "crawl", "curl", "email", "cancel", "label", "pour", "clear", "pair", "order",
            "monitor", "develop", "focus", "sync", "verify", "pay", "say", "go", "do", "try",
            "buy", "hang", "draft", "confirm", "track", "text", "list",
        ] {
            assert_eq!(base_form(&format!("{base}ing")), base, "{base}ing");
        }
    }

    #[test]
    fn irregular_gerunds() {
        assert_eq!(base_form("lying low"), "lie low");
        assert_eq!(base_form("dying"), "die");
        assert_eq!(base_form("tying it together"), "tie it together");
        assert_eq!(base_form("panicking"), "panic");
        assert_eq!(base_form("being there"), "be there");
    }

    #[test]
    fn case_is_kept() {
        assert_eq!(base_form("Checking"), "Check");
        assert_eq!(base_form("CHECKING YOUR BILLING"), "CHECK YOUR BILLING");
    }

    #[test]
    fn tables_are_sorted() {
        assert!(E_VERBS.windows(2).all(|w| w[0] < w[1]));
        assert!(E_VERBS.iter().all(|v| v.ends_with('e')));
    }
}
