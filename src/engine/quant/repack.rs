//! The repack route: MLX affine 4-bit weights with a group size that is a multiple of 32 map
//! losslessly onto ggml/candle `Q4_1` blocks (32 codes, `w = d * q + m`, `d` and `m` in f16):
//! one MLX group becomes `group_size / 32` blocks sharing its scale and bias. Only the nibble
//! order changes (MLX packs codes 2i, 2i+1 into byte i; Q4_1 packs codes j and j+16 of a block
//! into byte j) and bf16 becomes f16, which is exact unless a value falls outside f16's range or
//! into its subnormals with too many significant bits: such a matrix is refused, and the caller
//! keeps the native kernels for it. candle's own `QMatMul` kernels (CPU, CUDA, Metal) then run
//! the product; on the CPU they round activations to 8 bits (Q8_1), which the fixture tests bound.

use std::borrow::Cow;

use candle_core::quantized::{GgmlDType, QMatMul as CandleQMatMul, QStorage, QTensor};
use candle_core::Device;
use half::f16;

use crate::engine::error::{EngineError, Result};
use crate::engine::quant::QMatrix;

/// Bytes of one `Q4_1` block: f16 d, f16 m, 16 bytes of nibbles.
pub const Q4_1_BLOCK_BYTES: usize = 20;

/// Why a matrix cannot be repacked; the caller keeps the native path.
#[derive(Debug, thiserror::Error, PartialEq)]
pub enum RepackError {
    #[error("{name}: only 4-bit weights repack to Q4_1 (this one has {bits} bits)")]
    Bits { name: String, bits: usize },
    #[error("{name}: group_size {group_size} is not a multiple of Q4_1's 32")]
    GroupSize { name: String, group_size: usize },
    #[error("{name}: {what} {value:e} of row {row}, group {group} is not exact in f16 (it would become {became:e})")]
    Inexact {
        name: String,
        what: &'static str,
        row: usize,
        group: usize,
        value: f32,
        became: f32,
    },
}

/// The exact f16 of `v`, if there is one.
fn exact_f16(v: f32) -> Option<f16> {
    let h = f16::from_f32(v);
    (h.to_f32() == v || (v.is_nan() && h.is_nan())).then_some(h)
}

/// `w` as a row-major sequence of `Q4_1` blocks (`rows * cols / 32` of them).
pub fn to_q4_1_bytes(w: &QMatrix) -> std::result::Result<Vec<u8>, RepackError> {
    let (bits, gs) = (w.params.bits, w.params.group_size);
    if bits != 4 {
        return Err(RepackError::Bits {
            name: w.name.clone(),
            bits,
        });
    }
    if gs % 32 != 0 {
        return Err(RepackError::GroupSize {
            name: w.name.clone(),
            group_size: gs,
        });
    }
    let groups = w.groups_per_row();
    let (sv, bv) = (w.scales.view(), w.biases.view());
    let mut out = Vec::with_capacity(w.rows * w.cols / 32 * Q4_1_BLOCK_BYTES);
    for r in 0..w.rows {
        let row = &w.packed[r * w.row_bytes()..(r + 1) * w.row_bytes()];
        for g in 0..groups {
            let i = r * groups + g;
            let check = |what: &'static str, v: f32| {
                exact_f16(v).ok_or_else(|| RepackError::Inexact {
                    name: w.name.clone(),
                    what,
                    row: r,
                    group: g,
                    value: v,
                    became: f16::from_f32(v).to_f32(),
                })
            };
            let d = check("scale", sv.get(i))?;
            let m = check("bias", bv.get(i))?;
            for blk in 0..gs / 32 {
                // 32 codes = 16 bytes of the MLX row
                let src = &row[(g * gs + blk * 32) / 2..][..16];
                out.extend_from_slice(&d.to_le_bytes());
                out.extend_from_slice(&m.to_le_bytes());
                let code = |j: usize| (src[j / 2] >> (4 * (j % 2))) & 0x0f;
                for j in 0..16 {
                    out.push(code(j) | (code(j + 16) << 4));
                }
            }
        }
    }
    Ok(out)
}

/// `w` repacked into a candle `QTensor` on `device`.
pub fn to_qtensor(
    w: &QMatrix,
    device: &Device,
) -> Result<std::result::Result<QTensor, RepackError>> {
    let bytes = match to_q4_1_bytes(w) {
        Ok(b) => b,
        Err(e) => return Ok(Err(e)),
    };
    let storage = QStorage::from_data(Cow::Owned(bytes), device, GgmlDType::Q4_1)
        .map_err(EngineError::from)?;
    Ok(Ok(QTensor::new(storage, (w.rows, w.cols))?))
}

/// candle's matmul over the repacked matrix.
pub fn qmatmul(
    w: &QMatrix,
    device: &Device,
) -> Result<std::result::Result<CandleQMatMul, RepackError>> {
    Ok(match to_qtensor(w, device)? {
        Ok(t) => Ok(CandleQMatMul::from_qtensor(t)?),
        Err(e) => Err(e),
    })
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::engine::quant::testutil::random_qmatrix;
    use crate::engine::weights::{Bytes, Dtype};
    use candle_core::Module;

    #[test]
    fn q4_1_dequantizes_to_exactly_the_mlx_values() {
        for gs in [32, 64, 128] {
            for sd in [Dtype::BF16, Dtype::F16] {
                let w = random_qmatrix(24, 256, 4, gs, sd, gs as u64);
                let qt = to_qtensor(&w, &Device::Cpu).unwrap().unwrap();
                let got: Vec<f32> = qt
                    .dequantize(&Device::Cpu)
                    .unwrap()
                    .flatten_all()
                    .unwrap()
                    .to_vec1()
                    .unwrap();
                assert_eq!(got, w.dequantize(), "group {gs} {sd}");
            }
        }
    }

    #[test]
    fn values_f16_cannot_hold_are_refused_and_other_widths_are_left_native() {
        let mut w = random_qmatrix(4, 64, 4, 64, Dtype::BF16, 1);
        // 1e-7 in bf16 is a deep f16 subnormal: its low bits would be lost
        let mut s = w.scales.bytes.to_vec();
        s[2..4].copy_from_slice(&half::bf16::from_f32(1.0e-7).to_le_bytes());
        w.scales.bytes = Bytes::from_vec(s);
        match to_q4_1_bytes(&w) {
            Err(RepackError::Inexact {
                row: 1,
                group: 0,
                what: "scale",
                ..
            }) => {}
            other => panic!("expected an inexact-scale refusal, got {other:?}"),
        }
        let w8 = random_qmatrix(4, 64, 8, 64, Dtype::BF16, 1);
        assert!(matches!(
            to_q4_1_bytes(&w8),
            Err(RepackError::Bits { bits: 8, .. })
        ));
    }

    #[test]
    fn candle_q4_1_matmul_stays_close_to_the_reference() {
        use rand::{Rng, SeedableRng};
        let w = random_qmatrix(96, 512, 4, 64, Dtype::BF16, 9);
        let mut rng = rand::rngs::StdRng::seed_from_u64(2);
        let x: Vec<f32> = (0..3 * 512).map(|_| rng.random_range(-1f32..1.0)).collect();
        let want = w.matmul_reference(&x, 3);
        let mm = qmatmul(&w, &Device::Cpu).unwrap().unwrap();
        let xt = candle_core::Tensor::from_vec(x, (3, 512), &Device::Cpu).unwrap();
        let got: Vec<f32> = mm
            .forward(&xt)
            .unwrap()
            .flatten_all()
            .unwrap()
            .to_vec1()
            .unwrap();
        let scale = want.iter().fold(0f32, |m, v| m.max(v.abs()));
        let err = got
            .iter()
            .zip(&want)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()))
            / scale;
        // Q8_1 activations: 8-bit rounding per 32 values, ~2^-8 relative per product
        assert!(err < 2e-2, "relative error {err:.2e}");
    }
}
