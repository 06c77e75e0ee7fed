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

/// `null` read as `T::default()` (a field some servers send as `null` where the API
/// has a value, e.g. an empty list).
pub(crate) fn null_as_default<'de, D, T>(d: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<T>::deserialize(d)?.unwrap_or_default())
}

/// A list that may be `null` (read as empty) and whose `null` elements read as
/// `T::default()`: vLLM's legacy `top_logprobs` (`Optional[List[Optional[Dict]]]`).
pub(crate) fn list_with_nulls<'de, D, T>(d: D) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de> + Default,
{
    Ok(Option::<Vec<Option<T>>>::deserialize(d)?
        .unwrap_or_default()
        .into_iter()
        .map(Option::unwrap_or_default)
        .collect())
}

/// A list of logprobs whose `null` elements (the legacy `token_logprobs` of a token
/// with no probability, e.g. the first echoed prompt token; vLLM:
/// `List[Optional[float]]`) read as `-inf`, which is also what serde_json writes as
/// `null`. A `null` list reads as empty.
pub(crate) fn logprobs_with_nulls<'de, D>(d: D) -> Result<Vec<f64>, D::Error>
where
    D: Deserializer<'de>,
{
    Ok(Option::<Vec<Option<f64>>>::deserialize(d)?
        .unwrap_or_default()
        .into_iter()
        .map(|l| l.unwrap_or(f64::NEG_INFINITY))
        .collect())
}

/// An error `code` as a string: OpenAI sends a string or `null`; vLLM and llama.cpp's
/// server send the HTTP status as an integer, read here as its decimal text.
pub(crate) fn code_text<'de, D>(d: D) -> Result<Option<String>, D::Error>
where
    D: Deserializer<'de>,
{
    struct V;
    impl<'de> Visitor<'de> for V {
        type Value = Option<String>;
        fn expecting(&self, f: &mut fmt::Formatter) -> fmt::Result {
            f.write_str("a string, an integer or null")
        }
        fn visit_str<E: de::Error>(self, s: &str) -> Result<Self::Value, E> {
            Ok(Some(s.to_string()))
        }
        fn visit_i64<E: de::Error>(self, n: i64) -> Result<Self::Value, E> {
            Ok(Some(n.to_string()))
        }
        fn visit_u64<E: de::Error>(self, n: u64) -> Result<Self::Value, E> {
            Ok(Some(n.to_string()))
        }
        fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
        fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
            Ok(None)
        }
    }
    d.deserialize_any(V)
}

/// A JSON object with a string `type` (an internally tagged union of the wire), read
/// whole so that its other fields can be taken one by one. serde's derived internally
/// tagged enums read through a buffer that forgets where an error is (a wrong type
/// inside a variant is reported without its path) and cannot keep an unknown `type`
/// with the known variants' fields; an enum read through `Tagged` names the field at
/// fault (`at `delta.text`: ...`, see [`crate::error_path`]) and turns an unknown
/// `type` into its `Unknown` variant.
pub(crate) struct Tagged {
    kind: String,
    fields: serde_json::Map<String, serde_json::Value>,
}

impl Tagged {
    /// Reads an object with a string `type`; `what` names it in errors.
    pub(crate) fn read<'de, D: Deserializer<'de>>(d: D, what: &str) -> Result<Self, D::Error> {
        let mut fields = serde_json::Map::<String, serde_json::Value>::deserialize(d)?;
        match fields.remove("type") {
            Some(serde_json::Value::String(kind)) => Ok(Tagged { kind, fields }),
            Some(_) => Err(de::Error::custom(format!(
                "at `type`: {what}'s `type` must be a string"
            ))),
            None => Err(de::Error::custom(format!("{what} without a `type`"))),
        }
    }

    /// The `type` word.
    pub(crate) fn kind(&self) -> &str {
        &self.kind
    }

    /// The `type` word, taken (for an unknown type).
    pub(crate) fn into_kind(self) -> String {
        self.kind
    }

    /// The required field `name`.
    pub(crate) fn take<T: de::DeserializeOwned, E: de::Error>(
        &mut self,
        name: &'static str,
    ) -> Result<T, E> {
        match self.fields.remove(name) {
            Some(v) => field(name, v),
            None => Err(E::missing_field(name)),
        }
    }

    /// The field `name`, `T::default()` when absent or `null`.
    pub(crate) fn take_or_default<T: de::DeserializeOwned + Default, E: de::Error>(
        &mut self,
        name: &'static str,
    ) -> Result<T, E> {
        match self.fields.remove(name) {
            None | Some(serde_json::Value::Null) => Ok(T::default()),
            Some(v) => field(name, v),
        }
    }
}

/// The value `v` of field `name` as `T`; an error says where in `v` it is.
fn field<T: de::DeserializeOwned, E: de::Error>(name: &str, v: serde_json::Value) -> Result<T, E> {
    serde_path_to_error::deserialize(v).map_err(|e| {
        let inner = e.path().to_string();
        let (path, message) = crate::error_path(&inner, &e.into_inner().to_string());
        E::custom(format!("at `{}`: {message}", crate::join_path(name, &path)))
    })
}
