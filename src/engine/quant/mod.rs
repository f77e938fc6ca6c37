//! MLX affine quantization (`mx.quantize(..., mode="affine")`): a row of K values is a
//! little-endian bitstream of `bits`-wide codes (low bits first; 3/5/6-bit codes straddle u32
//! words), with one `scale` and `bias` per `group_size` codes, `w = scale * q + bias`.
//! `QMatrix` holds such a matrix without unpacking it; `op::QMatMul` is the fused candle op
//! `y = x @ dequant(W)^T`, and `dequantize` / `matmul_reference` are the slow references that
//! the fused kernels are tested against.

pub mod op;
mod params;
pub mod repack;

pub use params::QParams;

use std::any::Any;
use std::sync::{Arc, OnceLock};

use half::f16;

use crate::engine::config::QuantParams;
use crate::engine::error::{EngineError, Result};
use crate::engine::weights::{Bytes, Dtype, HostTensor};

/// Scales or biases: one value per (row, group), kept in the file's dtype (bf16 usually) so the
/// weights stay memory-mapped; widening bf16 to f32 is exact and costs a shift in the kernel.
#[derive(Debug, Clone)]
pub struct GroupParams {
    pub dtype: Dtype,
    pub bytes: Bytes,
}

impl GroupParams {
    /// A borrowed view for hot loops: resolves `Bytes` once, not per value.
    #[inline]
    pub fn view(&self) -> ParamView<'_> {
        ParamView {
            dtype: self.dtype,
            bytes: &self.bytes,
        }
    }

    pub fn get(&self, i: usize) -> f32 {
        self.view().get(i)
    }

    /// How the GPU kernels (CUDA and MSL) are told the dtype: 0 bf16, 1 f16, 2 f32.
    pub fn kernel_code(&self) -> i32 {
        match self.dtype {
            Dtype::BF16 => 0,
            Dtype::F16 => 1,
            _ => 2,
        }
    }

    pub fn to_f32_vec(&self) -> Vec<f32> {
        let v = self.view();
        (0..self.bytes.len() / self.dtype.size())
            .map(|i| v.get(i))
            .collect()
    }
}

#[derive(Clone, Copy)]
pub struct ParamView<'a> {
    dtype: Dtype,
    bytes: &'a [u8],
}

impl<'a> ParamView<'a> {
    /// The raw little-endian bytes.
    pub fn raw(&self) -> &'a [u8] {
        self.bytes
    }

    /// Values `start..start + out.len()` into `out`: the dtype matched once, not per value
    /// as `get` does (a kernel's per-row fill).
    #[inline]
    pub fn read_into(&self, start: usize, out: &mut [f32]) {
        // as `get`: bf16 or f16, else f32 (the loader admits no other dtype here)
        let w = if matches!(self.dtype, Dtype::BF16 | Dtype::F16) {
            2
        } else {
            4
        };
        let b = &self.bytes[start * w..][..out.len() * w];
        match self.dtype {
            Dtype::BF16 => {
                for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
                    *o = f32::from_bits((u16::from_le_bytes([c[0], c[1]]) as u32) << 16);
                }
            }
            Dtype::F16 => {
                for (o, c) in out.iter_mut().zip(b.chunks_exact(2)) {
                    *o = f16::from_le_bytes([c[0], c[1]]).to_f32();
                }
            }
            _ => {
                for (o, c) in out.iter_mut().zip(b.chunks_exact(4)) {
                    *o = f32::from_le_bytes([c[0], c[1], c[2], c[3]]);
                }
            }
        }
    }

    #[inline(always)]
    pub fn get(&self, i: usize) -> f32 {
        let b = self.bytes;
        match self.dtype {
            // bf16 is the top half of an f32
            Dtype::BF16 => {
                f32::from_bits((u16::from_le_bytes([b[2 * i], b[2 * i + 1]]) as u32) << 16)
            }
            Dtype::F16 => f16::from_le_bytes([b[2 * i], b[2 * i + 1]]).to_f32(),
            _ => f32::from_le_bytes([b[4 * i], b[4 * i + 1], b[4 * i + 2], b[4 * i + 3]]),
        }
    }
}

/// A quantized matrix of `rows` outputs by `cols` inputs, as stored by mlx_lm.
#[derive(Debug, Clone)]
pub struct QMatrix {
    pub name: String,
    pub rows: usize,
    pub cols: usize,
    pub params: QuantParams,
    /// `rows * cols * bits / 8` bytes: row r starts at `r * row_bytes()`.
    pub packed: Bytes,
    pub scales: GroupParams,
    pub biases: GroupParams,
    /// Copies on accelerators, made on first use there.
    pub device_copy: DeviceCopy,
    /// A copy in another layout for the CPU's decode kernel (`cpu::tile16`), made at load
    /// where that kernel runs.
    pub cpu_copy: DeviceCopy,
}

/// A matrix's copy on the accelerator it runs on, made by that backend on first use (a
/// process uses one GPU). Typed by the backend that made it, so this file names no backend.
#[derive(Default, Clone)]
#[cfg_attr(not(any(feature = "cuda", bot_metal)), allow(dead_code))]
pub struct DeviceCopy(OnceLock<Arc<dyn Any + Send + Sync>>);

#[cfg_attr(not(any(feature = "cuda", bot_metal)), allow(dead_code))]
impl DeviceCopy {
    /// The copy, made by `make` the first time; `None` if a copy of another type is there.
    pub(crate) fn get_or_make<T: Any + Send + Sync, E>(
        &self,
        make: impl FnOnce() -> std::result::Result<T, E>,
    ) -> std::result::Result<Option<Arc<T>>, E> {
        if let Some(c) = self.0.get() {
            return Ok(c.clone().downcast::<T>().ok());
        }
        let made: Arc<dyn Any + Send + Sync> = Arc::new(make()?);
        Ok(self.0.get_or_init(|| made).clone().downcast::<T>().ok())
    }

    /// The copy, if one of type `T` was made.
    pub(crate) fn peek<T: Any>(&self) -> Option<&T> {
        self.0.get()?.downcast_ref::<T>()
    }

    /// Keeps `copy` unless one is there already.
    pub(crate) fn put<T: Any + Send + Sync>(&self, copy: T) {
        let _ = self.0.set(Arc::new(copy));
    }
}

impl std::fmt::Debug for DeviceCopy {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("DeviceCopy")
    }
}

impl QMatrix {
    /// Builds from the `weight` (U32), `scales` and `biases` tensors of one module, checking
    /// every shape against `rows` x `cols` and the quantization parameters.
    pub fn from_tensors(
        module: &str,
        rows: usize,
        cols: usize,
        params: QuantParams,
        weight: HostTensor,
        scales: HostTensor,
        biases: HostTensor,
    ) -> Result<Self> {
        let bad = |t: &HostTensor, why: String| EngineError::BadTensor {
            path: t.path.clone(),
            name: t.name.clone(),
            why,
        };
        if !cols.is_multiple_of(params.group_size) {
            return Err(bad(
                &weight,
                format!(
                    "input width {cols} is not a multiple of group_size {}",
                    params.group_size
                ),
            ));
        }
        if weight.dtype != Dtype::U32 {
            return Err(bad(
                &weight,
                format!("expected packed U32 codes, found {}", weight.dtype),
            ));
        }
        let words = cols * params.bits / 32;
        if weight.shape != [rows, words] {
            return Err(bad(
                &weight,
                format!(
                    "expected packed shape [{rows}, {words}] ({cols} inputs at {} bits), found {:?}",
                    params.bits, weight.shape
                ),
            ));
        }
        let groups = cols / params.group_size;
        for t in [&scales, &biases] {
            if !matches!(t.dtype, Dtype::BF16 | Dtype::F16 | Dtype::F32) {
                return Err(bad(
                    t,
                    format!("expected BF16, F16 or F32, found {}", t.dtype),
                ));
            }
            if t.shape != [rows, groups] {
                return Err(bad(
                    t,
                    format!(
                        "expected shape [{rows}, {groups}] (group_size {}), found {:?}",
                        params.group_size, t.shape
                    ),
                ));
            }
        }
        Ok(QMatrix {
            name: module.to_string(),
            rows,
            cols,
            params,
            packed: weight.bytes,
            scales: GroupParams {
                dtype: scales.dtype,
                bytes: scales.bytes,
            },
            biases: GroupParams {
                dtype: biases.dtype,
                bytes: biases.bytes,
            },
            device_copy: DeviceCopy::default(),
            cpu_copy: DeviceCopy::default(),
        })
    }

    pub fn groups_per_row(&self) -> usize {
        self.cols / self.params.group_size
    }

    pub fn row_bytes(&self) -> usize {
        self.cols * self.params.bits / 8
    }

    /// Bytes a full pass over the matrix reads (codes, scales, biases).
    pub fn nbytes(&self) -> usize {
        self.packed.len() + self.scales.bytes.len() + self.biases.bytes.len()
    }

    /// Unpacks the codes of `bytes` (a whole number of groups) into `out`.
    #[inline]
    pub fn unpack_codes(bits: usize, bytes: &[u8], out: &mut [u8]) {
        match bits {
            8 => out.copy_from_slice(&bytes[..out.len()]),
            4 => {
                for (o, &b) in out.chunks_exact_mut(2).zip(bytes) {
                    o[0] = b & 0x0f;
                    o[1] = b >> 4;
                }
            }
            2 => {
                for (o, &b) in out.chunks_exact_mut(4).zip(bytes) {
                    o[0] = b & 3;
                    o[1] = (b >> 2) & 3;
                    o[2] = (b >> 4) & 3;
                    o[3] = b >> 6;
                }
            }
            _ => {
                // 3, 5, 6 bits: 8 codes fill exactly `bits` bytes.
                let mask = (1u64 << bits) - 1;
                for (o, c) in out.chunks_exact_mut(8).zip(bytes.chunks_exact(bits)) {
                    let mut w = 0u64;
                    for (i, &b) in c.iter().enumerate() {
                        w |= (b as u64) << (8 * i);
                    }
                    for (j, v) in o.iter_mut().enumerate() {
                        *v = ((w >> (j * bits)) & mask) as u8;
                    }
                }
            }
        }
    }

    /// Slow reference: one dequantized row, exactly `scale * q + bias` in f32 like mlx.
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        let gs = self.params.group_size;
        let gb = gs * self.params.bits / 8;
        let row = &self.packed[r * self.row_bytes()..(r + 1) * self.row_bytes()];
        let mut codes = vec![0u8; gs];
        for g in 0..self.groups_per_row() {
            Self::unpack_codes(self.params.bits, &row[g * gb..(g + 1) * gb], &mut codes);
            let (s, b) = (
                self.scales.get(r * self.groups_per_row() + g),
                self.biases.get(r * self.groups_per_row() + g),
            );
            for (o, &q) in out[g * gs..(g + 1) * gs].iter_mut().zip(&codes) {
                *o = s * q as f32 + b;
            }
        }
    }

    /// Slow reference: the whole matrix dequantized, `rows x cols` row-major.
    pub fn dequantize(&self) -> Vec<f32> {
        let mut w = vec![0f32; self.rows * self.cols];
        for (r, row) in w.chunks_exact_mut(self.cols).enumerate() {
            self.dequantize_row(r, row);
        }
        w
    }

    /// Slow reference: dequantize, then `x (m x cols) @ W^T`, accumulated in f64.
    pub fn matmul_reference(&self, x: &[f32], m: usize) -> Vec<f32> {
        let w = self.dequantize();
        let mut y = vec![0f32; m * self.rows];
        for i in 0..m {
            let xr = &x[i * self.cols..(i + 1) * self.cols];
            for n in 0..self.rows {
                let wr = &w[n * self.cols..(n + 1) * self.cols];
                y[i * self.rows + n] = xr
                    .iter()
                    .zip(wr)
                    .map(|(&a, &b)| a as f64 * b as f64)
                    .sum::<f64>() as f32;
            }
        }
        y
    }
}

/// The arithmetic of the quantized products, on every backend (`--kernel`).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default, clap::ValueEnum)]
pub enum Numerics {
    /// f32 activations: bit-for-bit the arithmetic the mlx_lm fixtures are checked with
    #[default]
    Exact,
    /// 15-bit integer activations per 32 values, integer dot products (4-bit weights; AVX2 on
    /// the CPU, dp2a on CUDA; other cases compute as `exact`), fp16 prompt tiles on CUDA, the
    /// CPU's KV cache and LoRA copies in f16
    Fast,
    /// 8-bit integer activations (4-bit weights, CPU; prompts of 8 tokens or more with
    /// `vpdpbusd` on AVX-512 VNNI without AMX, other such prompts as `fast`), the CPU's KV
    /// cache and LoRA copies in f16: fastest, least exact
    Int8,
}

/// Random matrices of valid shape and parameters: test inputs, and the Metal backend's
/// load-time self-test (`metal::selftest`), which needs them in the shipped binary.
pub mod random {
    use super::*;
    use half::bf16;
    use rand::{Rng, SeedableRng};

    /// A random quantized matrix with valid, non-zero scales and biases, in `sdtype`.
    pub fn qmatrix(
        rows: usize,
        cols: usize,
        bits: usize,
        gs: usize,
        sdtype: Dtype,
        seed: u64,
    ) -> QMatrix {
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let packed: Vec<u8> = (0..rows * cols * bits / 8).map(|_| rng.random()).collect();
        let ng = rows * cols / gs;
        let enc = |v: f32| -> Vec<u8> {
            match sdtype {
                Dtype::BF16 => bf16::from_f32(v).to_le_bytes().to_vec(),
                Dtype::F16 => f16::from_f32(v).to_le_bytes().to_vec(),
                _ => v.to_le_bytes().to_vec(),
            }
        };
        let scales: Vec<u8> = (0..ng)
            .flat_map(|_| enc(rng.random_range(0.001f32..0.05)))
            .collect();
        let biases: Vec<u8> = (0..ng)
            .flat_map(|_| enc(rng.random_range(-0.4f32..0.4)))
            .collect();
        QMatrix {
            name: "test".into(),
            rows,
            cols,
            params: QuantParams {
                bits,
                group_size: gs,
            },
            packed: Bytes::from_vec(packed),
            scales: GroupParams {
                dtype: sdtype,
                bytes: Bytes::from_vec(scales),
            },
            biases: GroupParams {
                dtype: sdtype,
                bytes: Bytes::from_vec(biases),
            },
            device_copy: DeviceCopy::default(),
            cpu_copy: DeviceCopy::default(),
        }
    }
}

#[cfg(test)]
pub(crate) mod testutil {
    pub use super::random::qmatrix as random_qmatrix;

    /// Random 4-bit bf16 matrices of `(rows, cols, group size)`, named `m0`, `m1`, ...
    /// (seeded by their index).
    pub fn named_qmatrices(shapes: &[(usize, usize, usize)]) -> Vec<super::QMatrix> {
        shapes
            .iter()
            .enumerate()
            .map(|(i, &(r, k, gs))| {
                let mut w =
                    random_qmatrix(r, k, 4, gs, crate::engine::weights::Dtype::BF16, i as u64);
                w.name = format!("m{i}");
                w
            })
            .collect()
    }

    /// `w` with its own codes, scales and biases zeroed, sharing its copies (`cpu_copy`): a
    /// kernel that gives `w`'s outputs from it read them from a copy.
    pub fn blanked(w: &super::QMatrix) -> super::QMatrix {
        use crate::engine::weights::Bytes;
        let mut b = w.clone();
        b.packed = Bytes::from_vec(vec![0; w.packed.len()]);
        b.scales.bytes = Bytes::from_vec(vec![0; w.scales.bytes.len()]);
        b.biases.bytes = Bytes::from_vec(vec![0; w.biases.bytes.len()]);
        b
    }
}

#[cfg(test)]
mod tests {
    use super::testutil::random_qmatrix;
    use crate::engine::weights::Dtype;

    #[test]
    fn read_into_gives_get_values() {
        for (i, dt) in [Dtype::BF16, Dtype::F16, Dtype::F32]
            .into_iter()
            .enumerate()
        {
            let w = random_qmatrix(5, 256, 4, 64, dt, i as u64 + 3);
            let v = w.scales.view();
            let n = 5 * 4;
            for start in [0, 1, 7, n - 4] {
                let mut out = vec![f32::NAN; 4];
                v.read_into(start, &mut out);
                let want: Vec<u32> = (start..start + 4).map(|j| v.get(j).to_bits()).collect();
                let got: Vec<u32> = out.iter().map(|x| x.to_bits()).collect();
                assert_eq!(got, want, "{dt:?} from {start}");
                assert!(out.iter().any(|&x| x != 0.0), "{dt:?}: all zero");
            }
        }
    }
}
