//! The dimensions of one quantized product, laid out as the GPU kernels (CUDA and Metal) take them.

/// A quantized product's dimensions as every kernel takes them: mirrors `struct QParams` of
/// the MSL source and the leading integer arguments of the CUDA kernels.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct QParams {
    pub m: i32,
    pub n: i32,
    pub k: i32,
    pub bits: i32,
    pub group_size: i32,
    /// 0 bf16, 1 f16, 2 f32
    pub sdtype: i32,
}

impl QParams {
    /// `m` rows of x (or ids) against `w`.
    pub fn new(w: &super::QMatrix, m: usize) -> Self {
        QParams {
            m: m as i32,
            n: w.rows as i32,
            k: w.cols as i32,
            bits: w.params.bits as i32,
            group_size: w.params.group_size as i32,
            sdtype: w.scales.kernel_code(),
        }
    }

    pub fn to_bytes(self) -> [u8; 24] {
        let mut b = [0u8; 24];
        for (i, v) in [
            self.m,
            self.n,
            self.k,
            self.bits,
            self.group_size,
            self.sdtype,
        ]
        .iter()
        .enumerate()
        {
            b[4 * i..4 * i + 4].copy_from_slice(&v.to_le_bytes());
        }
        b
    }
}
