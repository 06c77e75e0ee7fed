//! Stop strings with hold-back: text that could still grow into a stop string is not
//! released, so a client never sees part of one.

/// Watches generated text for stop strings.
#[derive(Clone, Debug, Default)]
pub struct StopStrings {
    stops: Vec<String>,
    held: String,
}

/// What [`StopStrings::push`] decided.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct StopCheck {
    /// Text safe to release now.
    pub emit: String,
    /// Whether a stop string was found (text from it on is dropped).
    pub stopped: bool,
}

impl StopStrings {
    /// Watches for `stops` (empty strings are ignored).
    pub fn new(stops: &[String]) -> Self {
        StopStrings {
            stops: stops.iter().filter(|s| !s.is_empty()).cloned().collect(),
            held: String::new(),
        }
    }

    /// Adds generated text; returns what may be released and whether a stop string was
    /// completed. After a stop, the text before it is released and the rest dropped.
    pub fn push(&mut self, text: &str) -> StopCheck {
        self.held.push_str(text);
        if let Some(at) = self
            .stops
            .iter()
            .filter_map(|s| self.held.find(s.as_str()))
            .min()
        {
            let emit = self.held[..at].to_string();
            self.held.clear();
            return StopCheck {
                emit,
                stopped: true,
            };
        }
        // Hold back the longest suffix that is a proper prefix of some stop string.
        let mut keep = 0;
        for s in &self.stops {
            for (k, _) in s.char_indices().skip(1) {
                if k > keep && self.held.ends_with(&s[..k]) {
                    keep = k;
                }
            }
        }
        let cut = self.held.len() - keep;
        let emit = self.held[..cut].to_string();
        self.held.drain(..cut);
        StopCheck {
            emit,
            stopped: false,
        }
    }

    /// Whether it watches for no stop string (then [`StopStrings::push`] releases every
    /// piece as it comes).
    pub fn is_empty(&self) -> bool {
        self.stops.is_empty()
    }

    /// Ends generation without a stop: releases what was held back.
    pub fn finish(&mut self) -> String {
        std::mem::take(&mut self.held)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn run(stops: &[&str], pieces: &[&str]) -> (String, bool) {
        let mut s = StopStrings::new(&stops.iter().map(|x| x.to_string()).collect::<Vec<_>>());
        let mut out = String::new();
        for p in pieces {
            let c = s.push(p);
            out.push_str(&c.emit);
            if c.stopped {
                return (out, true);
            }
        }
        out.push_str(&s.finish());
        (out, false)
    }

    #[test]
    fn stop_split_across_pieces_is_never_emitted() {
        let (out, stopped) = run(&["STOP"], &["Hello S", "T", "OP world"]);
        assert_eq!((out.as_str(), stopped), ("Hello ", true));
    }

    #[test]
    fn held_prefix_is_released_when_it_does_not_complete() {
        let mut s = StopStrings::new(&["STOP".to_string()]);
        assert_eq!(s.push("Hello ST").emit, "Hello ");
        assert_eq!(s.push("ay").emit, "STay");
        assert_eq!(run(&["STOP"], &["ab", "ST"]), ("abST".to_string(), false));
    }

    #[test]
    fn earliest_stop_wins_and_multibyte_is_safe() {
        assert_eq!(run(&["é!", "b"], &["aé", "!b"]), ("a".to_string(), true));
        assert_eq!(
            run(&["\n\n"], &["line\n", "\nnext"]),
            ("line".to_string(), true)
        );
        assert_eq!(run(&["日本"], &["こ日", "本"]), ("こ".to_string(), true));
    }
}
