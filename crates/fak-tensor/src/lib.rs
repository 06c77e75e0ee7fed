//! fak-tensor
