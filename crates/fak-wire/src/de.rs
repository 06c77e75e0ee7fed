//! Deserializers for the wire's "a string or a list" unions. serde's `untagged` enums
//! answer any mismatch with "data did not match any variant of untagged enum X", which
//! names neither the field's expected forms nor the element at fault; these visitors say
//! what was expected in plain words and let an element's own error (with its path)
//! through.

use serde::de::{self, Deserialize, Deserializer, SeqAccess, Visitor};
use std::fmt;
use std::marker::PhantomData;

/// A string, made into `T` by `text`, or an array of `E`, made into `T` by `items`;
/// anything else is an error saying `expecting` (e.g. "a string or an array of input
/// items").
pub(crate) fn str_or_seq<'de, D, T, E>(
    d: D,
    expecting: &'static str,
    text: fn(String) -> T,
    items: fn(Vec<E>) -> T,
) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    E: Deserialize<'de>,
{
    struct V<T, E> {
        expecting: &'static str,
        text: fn(String) -> T,
        items: fn(Vec<E>) -> T,
        _e: PhantomData<E>,
    }
    impl<'de, T, E: Deserialize<'de>> Visitor<'de> for V<T, E> {
        type Value = T;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str(self.expecting)
        }
        fn visit_str<Er: de::Error>(self, s: &str) -> Result<T, Er> {
            Ok((self.text)(s.to_string()))
        }
        fn visit_string<Er: de::Error>(self, s: String) -> Result<T, Er> {
            Ok((self.text)(s))
        }
        fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<T, A::Error> {
            let mut v = Vec::with_capacity(seq.size_hint().unwrap_or(0).min(64));
            while let Some(e) = seq.next_element()? {
                v.push(e);
            }
            Ok((self.items)(v))
        }
    }
    d.deserialize_any(V {
        expecting,
        text,
        items,
        _e: PhantomData,
    })
}
