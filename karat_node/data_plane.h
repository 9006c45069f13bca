// The KARAT node's data plane (DESIGN.md §2 steps 2-4): frames from GPU
// nodes arrive on a Transport, are validated and routed to the device they
// name; each device's worker (or, for a short frame that finds it idle, the
// receive handler: DataPlaneOptions::inline_max_context) appends the new
// entries, runs Score -> Select -> Gather -> Attend and sends the attention
// output back to the sender.
//
//   kHello     sections[0] = the sender's address, sections[1] = its proof
//              (common/hello_proof.h; absent in plaintext mode): the sender
//              becomes a peer known by its src_node; answered with kHelloAck
//              (echoing step and session, so the sender can match it;
//              sections[0] = this node's proof over the hello's nonce).
//              With a data-plane secret only a hello that passes
//              PeerAdmission (karat_node/peer_admission.h) is taken, and
//              only frames from the peers it bound are handled; others are
//              dropped, counted (frames_refused.<reason>) and logged, never
//              answered.
//   kIndexQK   [q_codes n*Hi*Di B, q_scales n*Hi f32, weights n*Hi f32,
//               k_codes n*Di B, k_scales n f32]
//   kAttnQKV   [q n*H*q_dim f32, kv n*kv_dim bf16 (, flags u32)] ->
//              kAttnOut [out n*H*out_dim f32] with the same
//              layer/step/session. The optional flags section (bit 0,
//              kAttnFlagEndsPrefill: the segment ends its turn's prefill)
//              drives the once-per-turn metadata of the GQA methods. For the
//              GQA forms q is [q | q_i] per head and kv is k | v | k_i
//              (common/sparse_attention.h).
//
// MagicPIG's hyperplanes (`model.lsh_hyperplanes`) are the only weights a
// KARAT node holds: Create() reads them from DataPlaneOptions.model_dir.
//
// A frame that fails DecodeFrame is dropped, counted (frames_invalid, and
// per sending peer frames_invalid.<peer name>) and logged with the name of
// the peer the transport says sent it. A frame naming an unknown session or
// device, or with a section of the wrong length, is answered with kError
// (status code + message) and counted (errors); in plaintext mode one from a
// node that sent no kHello cannot be answered and is counted and logged with
// the transport's name for its sender (with a secret it is refused before it
// is handled). Replies carry this node's id as src_node.
#pragma once

#include <atomic>
#include <cstdint>
#include <map>
#include <memory>
#include <string>
#include <string_view>
#include <vector>

#include "absl/base/thread_annotations.h"
#include "absl/container/flat_hash_map.h"
#include "absl/status/status.h"
#include "absl/status/statusor.h"
#include "absl/synchronization/mutex.h"
#include "cluster.pb.h"
#include "common/frame.h"
#include "common/log_limiter.h"
#include "common/model_config.h"
#include "common/transport.h"
#include "karat_node/karat_device.h"
#include "karat_node/peer_admission.h"

namespace karat {

// DataPlaneOptions::inline_max_context's default and the most tokens of an
// inlined frame (decode segments).
inline constexpr int kDefaultInlineMaxContext = 4096;
inline constexpr int kInlineMaxTokens = 4;

struct DataPlaneOptions {
  int tokens_per_page = 64;
  // The model directory, read only for the weights an attention method
  // needs (MagicPIG's hyperplanes); may be empty for other methods.
  std::string model_dir;
  std::vector<DeviceOptions> devices;
  // Short frames run on the transport's thread (docs/data-plane.md, "Short
  // frames inline"): a kIndexQK or kAttnQKV frame of at most kInlineMaxTokens
  // tokens whose segment ends at or before this position, for a device
  // whose worker is idle and whose timing model is off, runs in the receive
  // handler instead of waking the device's worker, which saves the wake-up
  // (8-30 us here) twice a layer of a decode step. Longer work still goes
  // to the worker, so that one device's scan does not hold up the frames of
  // the others. 0: every frame goes to the worker.
  int inline_max_context = kDefaultInlineMaxContext;
};

// Thread safety: every public method may be called from any thread. The
// transport's receive handler decodes and hands work to a worker, or runs a
// short frame itself while its device's worker is idle.
class DataPlaneHandler {
 public:
  // Creates the devices and installs the receive handler on `transport`
  // (which must outlive the handler, or be shut down first).
  static absl::StatusOr<std::unique_ptr<DataPlaneHandler>> Create(
      const ModelConfig& config, const DataPlaneOptions& options,
      Transport* transport);
  ~DataPlaneHandler();  // Stop()s

  // This node's id, sent as src_node in replies.
  void set_node_id(uint32_t id) { node_id_.store(id); }
  uint32_t node_id() const { return node_id_.load(); }
  // Which senders are taken (open by default: plaintext). The daemon closes
  // it until its first registration, then sets the registration's secret
  // and the coordinator's table of nodes (KaratNode.SetLinks).
  PeerAdmission& admission() { return admission_; }

  struct Reserved {
    int64_t used_bytes = 0;     // the device's, afterwards
    bool kv_dropped = false;    // KaratDevice::ReserveResult
    int64_t session_bytes = 0;  // KaratDevice::ReserveResult
  };
  // KaratNode.Reserve: makes room for `tokens` positions of `session` on
  // `device` (creating its cache there on first use), fences its older
  // turns off and cuts what it stores beyond `kv_tokens` (-1: nothing; see
  // KaratDevice::Reserve). A session lives on one device: naming another is
  // FAILED_PRECONDITION. RESOURCE_EXHAUSTED and OUT_OF_RANGE change nothing.
  absl::StatusOr<Reserved> Reserve(uint64_t session, int device, int tokens,
                                   uint64_t turn_epoch = 0,
                                   int kv_tokens = -1);
  // KaratNode.FreeSession: frees every page of the session. NOT_FOUND when
  // the node does not hold it.
  absl::Status FreeSession(uint64_t session);
  // Frees every page of every session; returns how many sessions there
  // were. For a node registering again: the coordinator that placed them is
  // gone (restarted) or has dropped this node's earlier registration, so no
  // one will free them (DESIGN.md §7).
  int FreeAllSessions();

  int num_devices() const { return static_cast<int>(devices_.size()); }
  KaratDevice* device(int i) const { return devices_[i].get(); }
  std::vector<cluster::DeviceInfo> Devices() const;
  // frames_received, frames_inline (of those, run in the receive handler),
  // frames_invalid, frames_invalid.<peer> (per sender name), frames_refused
  // and frames_refused.<reason> (PeerAdmission), errors, kv_bytes_ingested,
  // sessions, used_bytes, capacity_bytes.
  std::map<std::string, double> Counters() const;

  // Stops accepting frames and joins the workers after their queued work.
  void Stop();

 private:
  DataPlaneHandler(const ModelConfig& config, Transport* transport);
  void OnMessage(PeerId from, std::string_view message);
  void HandleHello(const std::string& message, PeerId from);
  // Counts and logs a frame PeerAdmission refused.
  void Refuse(Refusal why, const FrameHeader& h, PeerId from);
  void HandleData(KaratDevice* device, PeerId from, const FrameView& frame);
  // Replies to the frame's sender; counts and logs when that fails.
  void Reply(const FrameHeader& request, FrameType type,
             const std::vector<std::string_view>& sections,
             uint32_t status_code);
  void ReplyError(const FrameHeader& request, const absl::Status& status,
                  PeerId from = kUnknownPeer);
  // The transport's name for a sender, for logs.
  std::string SenderName(PeerId from) const;

  const ModelConfig config_;
  Transport* const transport_;
  int inline_max_context_ = 0;
  std::vector<std::unique_ptr<KaratDevice>> devices_;
  std::atomic<uint32_t> node_id_{0};
  std::atomic<bool> stopped_{false};

  std::atomic<uint64_t> frames_received_{0};
  std::atomic<uint64_t> frames_inline_{0};
  std::atomic<uint64_t> frames_invalid_{0};
  std::atomic<uint64_t> errors_{0};
  // Replies whose asynchronous send failed after it was posted (counted in
  // "errors"); shared with the transport's callbacks.
  const std::shared_ptr<std::atomic<uint64_t>> reply_failures_ =
      std::make_shared<std::atomic<uint64_t>>(0);
  std::atomic<uint64_t> kv_bytes_ingested_{0};
  // Warnings about single frames (invalid, refused, unanswerable, a reply
  // that could not be sent) at most once per 10 s per peer and kind; the
  // counters above count every one. Shared with the send callbacks.
  const std::shared_ptr<LogLimiter> log_limiter_ =
      std::make_shared<LogLimiter>(absl::Seconds(10));
  // Invalid frames per sender name (only touched for invalid frames).
  mutable absl::Mutex invalid_mu_;
  std::map<std::string, uint64_t> invalid_by_peer_ ABSL_GUARDED_BY(invalid_mu_);

  // The senders taken, and the transport peer of each node id (learnt
  // from kHello).
  PeerAdmission admission_;

  // Session -> home device, for Reserve/FreeSession.
  mutable absl::Mutex sessions_mu_;
  absl::flat_hash_map<uint64_t, int> session_device_
      ABSL_GUARDED_BY(sessions_mu_);

  // Runs handshakes and error replies for frames no device takes, off the
  // transport's thread.
  SerialWorker control_{"control"};
};

}  // namespace karat
