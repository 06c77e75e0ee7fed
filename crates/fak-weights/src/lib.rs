//! fak-weights
