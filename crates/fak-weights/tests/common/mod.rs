//! A small GGUF writer for tests: builds valid files, and lets a test corrupt any
//! field on purpose. Layout per the GGUF spec (v2/v3, little-endian).
#![allow(dead_code)]

/// GGUF metadata value type ids.
pub mod vt {
    pub const U8: u32 = 0;
    pub const I8: u32 = 1;
    pub const U16: u32 = 2;
    pub const I16: u32 = 3;
    pub const U32: u32 = 4;
    pub const I32: u32 = 5;
    pub const F32: u32 = 6;
    pub const BOOL: u32 = 7;
    pub const STRING: u32 = 8;
    pub const ARRAY: u32 = 9;
    pub const U64: u32 = 10;
    pub const I64: u32 = 11;
    pub const F64: u32 = 12;
}

/// Encode a GGUF string (u64 length + bytes).
pub fn gstr(s: &str) -> Vec<u8> {
    let mut v = (s.len() as u64).to_le_bytes().to_vec();
    v.extend_from_slice(s.as_bytes());
    v
}

/// One tensor to write. `offset: None` places it after the previous one, aligned.
#[derive(Clone)]
pub struct TensorSpec {
    pub name: String,
    pub dims: Vec<u64>,
    pub type_id: u32,
    pub offset: Option<u64>,
    pub data: Vec<u8>,
}

/// A GGUF file under construction. Fields are public so tests can break them.
#[derive(Clone)]
pub struct Builder {
    pub magic: [u8; 4],
    pub version: u32,
    /// Overrides the written tensor count when set.
    pub tensor_count: Option<u64>,
    /// Overrides the written metadata count when set.
    pub kv_count: Option<u64>,
    /// (key, value type id, encoded value bytes)
    pub kvs: Vec<(String, u32, Vec<u8>)>,
    pub tensors: Vec<TensorSpec>,
    /// Alignment used for placing data (not written as metadata unless added).
    pub alignment: u64,
}

impl Default for Builder {
    fn default() -> Self {
        Builder {
            magic: *b"GGUF",
            version: 3,
            tensor_count: None,
            kv_count: None,
            kvs: Vec::new(),
            tensors: Vec::new(),
            alignment: 32,
        }
    }
}

impl Builder {
    pub fn kv(mut self, key: &str, ty: u32, value: Vec<u8>) -> Self {
        self.kvs.push((key.to_string(), ty, value));
        self
    }

    pub fn kv_u32(self, key: &str, v: u32) -> Self {
        self.kv(key, vt::U32, v.to_le_bytes().to_vec())
    }

    pub fn kv_str(self, key: &str, v: &str) -> Self {
        self.kv(key, vt::STRING, gstr(v))
    }

    /// Set `general.alignment` (u32) and use it for placement.
    pub fn alignment(mut self, a: u32) -> Self {
        self.alignment = u64::from(a).max(1);
        self.kv_u32("general.alignment", a)
    }

    pub fn tensor(mut self, name: &str, dims: &[u64], type_id: u32, data: Vec<u8>) -> Self {
        self.tensors.push(TensorSpec {
            name: name.to_string(),
            dims: dims.to_vec(),
            type_id,
            offset: None,
            data,
        });
        self
    }

    pub fn build(&self) -> Vec<u8> {
        let mut out = Vec::new();
        out.extend_from_slice(&self.magic);
        out.extend_from_slice(&self.version.to_le_bytes());
        out.extend_from_slice(
            &self
                .tensor_count
                .unwrap_or(self.tensors.len() as u64)
                .to_le_bytes(),
        );
        out.extend_from_slice(&self.kv_count.unwrap_or(self.kvs.len() as u64).to_le_bytes());
        for (k, ty, v) in &self.kvs {
            out.extend_from_slice(&gstr(k));
            out.extend_from_slice(&ty.to_le_bytes());
            out.extend_from_slice(v);
        }
        let align = |x: u64| x.div_ceil(self.alignment) * self.alignment;
        let mut next = 0u64;
        let mut placed = Vec::new();
        for t in &self.tensors {
            let off = t.offset.unwrap_or_else(|| align(next));
            next = off + t.data.len() as u64;
            placed.push(off);
            out.extend_from_slice(&gstr(&t.name));
            out.extend_from_slice(&(t.dims.len() as u32).to_le_bytes());
            for d in &t.dims {
                out.extend_from_slice(&d.to_le_bytes());
            }
            out.extend_from_slice(&t.type_id.to_le_bytes());
            out.extend_from_slice(&off.to_le_bytes());
        }
        let data_start = align(out.len() as u64);
        out.resize(data_start as usize, 0);
        for (t, off) in self.tensors.iter().zip(placed) {
            if t.data.is_empty() {
                continue;
            }
            let start = (data_start + off) as usize;
            if out.len() < start + t.data.len() {
                out.resize(start + t.data.len(), 0);
            }
            out[start..start + t.data.len()].copy_from_slice(&t.data);
        }
        out
    }
}

/// f32 values as little-endian bytes.
pub fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

/// A small valid file with every metadata value type (including a nested array),
/// an F32 tensor, a Q8_0 tensor and an F16 tensor, the last ending at EOF.
pub fn tiny_valid() -> Builder {
    let mut q8 = vec![0u8; 34 * 2];
    q8[0..2].copy_from_slice(&0x3c00u16.to_le_bytes()); // d = 1.0
    for j in 0..32 {
        q8[2 + j] = (j as i8 - 16) as u8;
    }
    q8[34..36].copy_from_slice(&0x3800u16.to_le_bytes()); // d = 0.5
    for j in 0..32 {
        q8[36 + j] = (j as u8).wrapping_mul(7);
    }
    let mut nested = Vec::new();
    nested.extend_from_slice(&vt::ARRAY.to_le_bytes());
    nested.extend_from_slice(&2u64.to_le_bytes());
    for inner in [[1i16, 2].as_slice(), &[3]] {
        nested.extend_from_slice(&vt::I16.to_le_bytes());
        nested.extend_from_slice(&(inner.len() as u64).to_le_bytes());
        for x in inner {
            nested.extend_from_slice(&x.to_le_bytes());
        }
    }
    let mut strs = Vec::new();
    strs.extend_from_slice(&vt::STRING.to_le_bytes());
    strs.extend_from_slice(&2u64.to_le_bytes());
    strs.extend_from_slice(&gstr("a"));
    strs.extend_from_slice(&gstr("bé"));
    Builder::default()
        .kv_str("general.architecture", "llama")
        .kv("t.u8", vt::U8, vec![200])
        .kv("t.i8", vt::I8, vec![0xfe])
        .kv("t.u16", vt::U16, 60000u16.to_le_bytes().to_vec())
        .kv("t.i16", vt::I16, (-300i16).to_le_bytes().to_vec())
        .kv_u32("t.u32", 4_000_000_000)
        .kv("t.i32", vt::I32, (-7i32).to_le_bytes().to_vec())
        .kv("t.f32", vt::F32, 1.5f32.to_le_bytes().to_vec())
        .kv("t.bool", vt::BOOL, vec![1])
        .kv("t.u64", vt::U64, u64::MAX.to_le_bytes().to_vec())
        .kv("t.i64", vt::I64, (-1i64).to_le_bytes().to_vec())
        .kv("t.f64", vt::F64, 0.25f64.to_le_bytes().to_vec())
        .kv("t.nested", vt::ARRAY, nested)
        .kv("t.strs", vt::ARRAY, strs)
        .tensor("norm.weight", &[3], 0, f32_bytes(&[1.0, -2.0, 0.5]))
        .tensor("embd.weight", &[32, 2], 8, q8)
        .tensor(
            "half.weight",
            &[2, 2],
            1,
            [0x3c00u16, 0xc000, 0x0001, 0x7c00]
                .iter()
                .flat_map(|h| h.to_le_bytes())
                .collect(),
        )
}
