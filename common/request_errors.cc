#include "common/request_errors.h"

#include <google/protobuf/stubs/logging.h>

#include <mutex>
#include <string>

#include "absl/strings/str_cat.h"
#include "common/log.h"
#include "common/log_limiter.h"

namespace karat {
namespace {

class ExplainInterceptor final : public grpc::experimental::Interceptor {
 public:
  explicit ExplainInterceptor(grpc::experimental::ServerRpcInfo* info)
      : info_(info) {}
  void Intercept(
      grpc::experimental::InterceptorBatchMethods* methods) override {
    if (methods->QueryInterceptionHookPoint(
            grpc::experimental::InterceptionHookPoints::PRE_SEND_STATUS)) {
      const grpc::Status st = methods->GetSendStatus();
      const grpc::Status explained = ExplainStatus(st, info_->method());
      if (explained.error_code() != st.error_code() ||
          explained.error_message() != st.error_message())
        methods->ModifySendStatus(explained);
    }
    methods->Proceed();
  }

 private:
  grpc::experimental::ServerRpcInfo* const info_;
};

class ExplainFactory final
    : public grpc::experimental::ServerInterceptorFactoryInterface {
 public:
  grpc::experimental::Interceptor* CreateServerInterceptor(
      grpc::experimental::ServerRpcInfo* info) override {
    return new ExplainInterceptor(info);
  }
};

LogLimiter& ProtobufLogLimiter() {
  static LogLimiter* limiter = new LogLimiter(absl::Minutes(1));
  return *limiter;
}

void ProtobufLog(google::protobuf::LogLevel level, const char* filename,
                 int line, const std::string& message) {
  const int64_t held =
      ProtobufLogLimiter().Admit(absl::StrCat(filename, ":", line));
  if (held < 0) return;
  if (level >= google::protobuf::LOGLEVEL_ERROR) {
    KLOG(Warning, "protobuf") << message << HeldBackNote(held);
  } else {
    KLOG(Info, "protobuf") << message << HeldBackNote(held);
  }
}

}  // namespace

std::vector<
    std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
RequestErrorInterceptors() {
  std::vector<
      std::unique_ptr<grpc::experimental::ServerInterceptorFactoryInterface>>
      v;
  v.push_back(std::make_unique<ExplainFactory>());
  return v;
}

grpc::Status ExplainStatus(const grpc::Status& status, const char* method) {
  if (status.error_code() != grpc::StatusCode::INTERNAL ||
      !status.error_message().empty())
    return status;
  return grpc::Status(
      grpc::StatusCode::INVALID_ARGUMENT,
      absl::StrCat("the request to ", method == nullptr ? "" : method,
                   " could not be parsed as its message: a string field "
                   "(such as session_id) must be valid UTF-8, and the bytes "
                   "must be the method's request message"));
}

void InstallProtobufLogLimiter() {
  static std::once_flag once;
  std::call_once(once, [] { google::protobuf::SetLogHandler(&ProtobufLog); });
}

}  // namespace karat
