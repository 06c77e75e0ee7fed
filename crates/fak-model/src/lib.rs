//! fak-model
